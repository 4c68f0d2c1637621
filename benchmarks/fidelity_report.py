"""A fidelity run's verdicts and figures (benchmarks/fidelity.py), from its cases' results:
per case a line of errors, regret and baselines, each target met, missed or within the
machine's noise (a sign test on the pairs: benchmarks/paired.py); over the run, the median
error, the outcomes, the error between plans of one model and where the measured steps' time
went along their critical paths."""

from __future__ import annotations

import json
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from paired import baseline_verdicts, regret_verdict, worst

BASELINES = ("uniform", "parameters", "torchgpipe", "conventional")
TARGET_ERROR, TARGET_REGRET = 0.20, 0.03


def spread(times: list[float]) -> float:
    """How far launches of one plan land apart: (max − min) ÷ median."""
    return (max(times) - min(times)) / statistics.median(times)


def verdict(s: dict[str, Any]) -> str:
    """One line per case: errors, regret and the baselines, each target met, missed (a sign
    test on the pairs: benchmarks/paired.py) or within the machine's noise."""
    faster: dict[float, list[str]] = {}  # one plan may be several baselines
    for role, ratio in s["pick_vs_baselines"].items():
        if ratio < 1:
            faster.setdefault(ratio, []).append(role)
    judged = baseline_verdicts(s["plans"], BASELINES)
    slower = [f"{', '.join(roles)} {ratio:.3f} ({judged[roles[0]].describe()})"
              for ratio, roles in faster.items()]
    regret = regret_verdict(s["plans"], TARGET_REGRET)
    return (f"{s['case']}: median error {s['median_error']:+.1%}, worst {s['worst_error']:+.1%}, "
            f"rank correlation {s['rank_correlation']:.2f}, regret {s['regret']:.1%} "
            f"({regret.describe()}); "
            + ("pick ≥ every baseline" if not slower else
               "a baseline measured faster (its step ÷ pipec's): " + ", ".join(slower))
            + f"; the pick's {s['pick_launches']} launches spread {s['pick_spread']:.1%}")


def report(results: list[dict[str, Any]]) -> None:
    median = statistics.median(abs(r["median_error"]) for r in results)
    regret = max(r["regret"] for r in results)
    regrets = Counter(regret_verdict(r["plans"], TARGET_REGRET).outcome for r in results)
    baselines = Counter(worst(list(baseline_verdicts(r["plans"], BASELINES).values())).outcome
                        for r in results)
    noise = [r["pick_spread"] for r in results]
    print(f"\n{len(results)} cases: median step-time error {median:.1%} (target ±"
          f"{TARGET_ERROR:.0%}); worst regret {regret:.1%}, the regret target (≤ "
          f"{TARGET_REGRET:.0%}) {_outcomes(regrets)}; pick ≥ every baseline "
          f"{_outcomes(baselines)}; the pick's launches spread a median "
          f"{statistics.median(noise):.1%}")
    between = between_plans(results)
    print(f"between plans of one model: measured ÷ predicted sits a median {between[0]:.1%} "
          f"(75th percentile {between[1]:.1%}) from its model's other plans' median ratio, over "
          f"{sum(len(r['plans']) for r in results)} plans (planning.choice's margin)")
    print(path_line(results))


def path_line(results: list[dict[str, Any]]) -> str:
    """Where the measured steps' time went (pipec.critical), median over the pipelined plans:
    the waits the model charges only as links and time per action."""
    paths = [p["critical_path"] for r in results for p in r["plans"]
             if p.get("critical_path", {}).get("hops")]
    if not paths:
        return "critical path: no pipelined plan's timelines recorded"
    def share(part: str) -> float:
        return statistics.median(p[part] / sum(v for k, v in p.items() if k != "hops")
                                 for p in paths)
    hop = statistics.median(p["waits for inputs"] / p["hops"] for p in paths)
    return (f"critical path of {len(paths)} pipelined plans (median): compute "
            f"{share('compute'):.1%} of the step, waits for inputs {share('waits for inputs'):.1%}"
            f" ({hop * 1e3:.2f} ms a hop), between own actions "
            f"{share('between own actions'):.1%}, after the last action "
            f"{share('after the last action'):.1%}")


def _outcomes(counts: Counter[str]) -> str:
    """How many cases each verdict had, e.g. "met in 6, within noise in 2, missed in 1"."""
    return ", ".join(f"{outcome} in {counts[outcome]}"
                     for outcome in ("met", "within noise", "missed") if counts[outcome])


def read_results(path: Path) -> list[dict[str, Any]]:
    """The cases of a file fidelity.py --json wrote; exits with the fix for any other file."""
    try:
        results: list[dict[str, Any]] = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--report {path}: {exc}; give a file fidelity.py --json wrote"
                         ) from None
    if not isinstance(results, list):
        raise SystemExit(f"--report {path}: not a list of cases; give a file fidelity.py "
                         "--json wrote")
    if not all("paired" in p for r in results for p in r["plans"]):
        raise SystemExit(f"--report {path}: its plans have no pairs of launches (a run before "
                         "the fifth session's): there is nothing to judge them by")
    for r in results:  # runs before the sixth session's did not keep the pick's launches
        pick = next(p for p in r["plans"] if "pipec" in p["roles"])
        r.setdefault("pick_launches", len(pick["measured_s"]))
        r.setdefault("pick_spread", spread(pick["measured_s"]))
    return results


def between_plans(results: list[dict[str, Any]]) -> tuple[float, float]:
    """The time model's error between plans of one model, what decides between them: each
    plan's measured ÷ predicted step against the other plans' median ratio in its case (median,
    75th pct)."""
    deviations = []
    for r in results:
        ratios = [statistics.median(p["measured_s"]) / p["predicted_s"] for p in r["plans"]]
        # Against the others' median: with its own in it, a case's middle plan counts an exact
        # 0 (8 of 52 plans in the sixth session's run, 4 of 54 in the fifth).
        deviations += [abs(x / statistics.median(ratios[:i] + ratios[i + 1:]) - 1)
                       for i, x in enumerate(ratios)]
    return statistics.median(deviations), float(np.percentile(deviations, 75))
