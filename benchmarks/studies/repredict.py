"""Score the present time model against a saved fidelity run: no launches, only compiles.

Every plan a `benchmarks/fidelity.py --json` run trained is compiled again with the present
pipec, pinned to the run's layout, micro-batch, schedule, virtual stages and boundaries (below),
and its step predicted again from this machine's measurements (pipec's cache,
measured once where missing: `--cache DIR` keeps them apart). The run's measured steps do not
change, so a change to the model is judged on an hour of launches in well under a minute
(re-predicting the 54 plans of the fourteenth session's run: 32 s with its measurements
cached). Per case it prints each plan's step as predicted then and now, as measured, and both
errors; then, then and now:

- the median step-time error (median over cases of each case's median, as fidelity.py);
- the error between plans of one model (fidelity_report.py's `between_plans`): what decides between
  plans, and what planning.choice's margin must cover;
- the regret of the plan predicted fastest among those the run measured (its step ÷ the
  fastest measured, from the run's paired launches): the margin and the complexity order left
  out, so a change to the model alone shows;
- now, the regret of the plan planning.choice keeps among those measured, at the present
  decision margin and at others (`--margins`): how much the margin costs or saves.

Each plan's stage boundaries are pinned to the run's (`boundaries` in the JSON, since the
fifteenth session's runs; `pipec compile --boundaries`). An older run's are solved again: where
the model's change moves them, the plan compiled is not quite the plan measured (marked *).

    python benchmarks/studies/repredict.py benchmarks/results/fidelity.json [MORE.json ...]
                                           [--only NAME ...] [--cache DIR]
                                           [--margins PERCENT ...] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from tabulate import tabulate

from pipec.cli import main as pipec
from pipec.planning.choice import MEASURED_MARGIN, complexity, simplest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from commands import ROOT
from fidelity import CASES
from fidelity_report import BASELINES, between_plans

_LABEL = re.compile(r"(\d+)×(\d+), m (\d+), ([\w-]+)(?: v=(\d+))?(?:, FSDP ([\w-]+))?$")


def plan_flags(roles: list[str], label: str,
               boundaries: list[list[int]] | None = None) -> list[str]:
    """`pipec compile`'s flags that pin a saved plan: the label's (fidelity.Entry.label:
    "2×1, m 64, zbv v=2") layout, micro-batch, schedule, virtual stages and sharding, and its
    stage boundaries where the run saved them (each stage's [first, end) nodes), else a
    baseline's strategy for them (its point pinned too: the strategy's own choice of point
    moves with the measurements, and the plan measured is the one to predict)."""
    baseline = next((r for r in roles if r in BASELINES), None)
    strategy = ["--strategy", baseline] if baseline else []
    if boundaries and len(boundaries) > 1:  # the same plan, whichever strategy placed them
        strategy = ["--boundaries", ",".join(str(stage[0]) for stage in boundaries[1:])]
    match = _LABEL.match(label)
    if match is None:
        raise SystemExit(f"plan {label!r}: not a fidelity.py plan label (pp×dp, m N, schedule)")
    pp, _, micro_batch, schedule, virtual, fsdp = match.groups()
    flags = ["--pp", pp, "--micro-batch", micro_batch, "--fsdp", fsdp or "off"]
    if int(pp) > 1:  # one stage runs every schedule alike ("-" in its key)
        flags += ["--schedule", schedule]
    return strategy + flags + (["--virtual-stages", virtual] if virtual else [])


def predict_again(case: dict[str, Any], plan: dict[str, Any], work: Path,
                  hardware: str = "cpu") -> dict[str, Any]:
    """The present model's plan.json for one saved plan of ``case`` (on ``hardware``: the run's,
    this machine's CPU)."""
    known = {c.name: c for c in CASES}
    if case["case"] not in known:
        raise SystemExit(f"case {case['case']!r} is not one of fidelity.py's cases")
    model = ROOT / known[case["case"]].model
    argv = ["compile", str(model), "--gpus", str(case["processes"]), "--hardware", hardware,
            "--batch-size", str(case["batch"]),
            *plan_flags(plan["roles"], plan["plan"], plan.get("boundaries")),
            "-o", str(work)]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        code = pipec(argv)
    if code:
        raise SystemExit(f"pipec {' '.join(argv)} failed:\n{printed.getvalue()}")
    result: dict[str, Any] = json.loads((work / "plan.json").read_text())
    return result


def repredicted(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``results`` with each plan's ``predicted_s`` the present model's (the saved one kept as
    ``predicted_then_s``) and ``moved`` where its boundaries differ from the saved ones."""
    again = []
    for case in results:
        plans = []
        for plan in case["plans"]:
            with tempfile.TemporaryDirectory() as tmp:
                now = predict_again(case, plan, Path(tmp))
            boundaries = [s["nodes"] for s in now["stages"]]
            plans.append({**plan, "predicted_then_s": plan["predicted_s"],
                          "predicted_s": now["predicted"]["iteration_s"],
                          "moved": "boundaries" in plan and plan["boundaries"] != boundaries,
                          "complexity": list(complexity(
                              now["virtual_stages"], now["schedule"], now["pp"],
                              now["micro_batch"], now["fsdp"]))})
        again.append({**case, "plans": plans})
        print(f"\n### {case['case']}\n\n{table(plans)}", flush=True)
    return again


def table(plans: list[dict[str, Any]]) -> str:
    rows = [(", ".join(p["roles"]), p["plan"] + (" *" if p["moved"] else ""),
             f"{p['predicted_then_s'] * 1e3:.1f}", f"{p['predicted_s'] * 1e3:.1f}",
             f"{_measured(p) * 1e3:.1f}", f"{_measured(p) / p['predicted_then_s'] - 1:+.1%}",
             f"{_measured(p) / p['predicted_s'] - 1:+.1%}") for p in plans]
    return tabulate(rows, ("plan of", "pp×dp, micro-batch, schedule", "predicted then ms",
                           "predicted now ms", "measured ms", "error then", "error now"),
                    tablefmt="github")


def _measured(plan: dict[str, Any]) -> float:
    return statistics.median(plan["measured_s"])


def median_error(results: list[dict[str, Any]]) -> float:
    """fidelity.py's figure: the median over cases of |each case's median error|."""
    return statistics.median(abs(statistics.median(_measured(p) / p["predicted_s"] - 1
                                                   for p in r["plans"])) for r in results)


def fastest_predicted_regret(case: dict[str, Any]) -> float:
    """The measured plan predicted fastest, its step over the fastest measured's − 1 (the
    paired ratios to the run's pick: fidelity.Entry.relative)."""
    chosen = min(case["plans"], key=lambda p: p["predicted_s"])
    best = min(statistics.median(p["paired"]) for p in case["plans"])
    return statistics.median(chosen["paired"]) / best - 1


def kept_regret(case: dict[str, Any], margin: float) -> float:
    """The regret of the plan planning.choice keeps among the measured ones at ``margin``: the
    fastest of the simplest within the margin of the fastest predicted."""
    best = min(p["predicted_s"] for p in case["plans"])
    within = [p for p in case["plans"] if p["predicted_s"] <= best * (1 + margin)]
    kept = min(simplest(within, lambda p: tuple(p["complexity"])),
               key=lambda p: p["predicted_s"])
    return statistics.median(kept["paired"]) / min(statistics.median(p["paired"])
                                                   for p in case["plans"]) - 1


def margin_lines(results: list[dict[str, Any]], margins: list[float]) -> str:
    lines = []
    for margin in sorted({round(m, 6) for m in (*margins, MEASURED_MARGIN)}):
        regrets = [kept_regret(r, margin) for r in results]
        present = " (the present margin)" if math.isclose(margin, MEASURED_MARGIN) else ""
        lines.append(f"kept at a margin of {margin:.1%}{present}: regret above 3 % in "
                     f"{sum(g > 0.03 for g in regrets)} of {len(regrets)} cases, mean "
                     f"{statistics.mean(regrets):.1%}, worst {max(regrets):.1%}")
    return "\n".join(lines)


def summary(results: list[dict[str, Any]]) -> str:
    then = [{**r, "plans": [{**p, "predicted_s": p["predicted_then_s"]} for p in r["plans"]]}
            for r in results]
    lines = []
    for name, run in (("then", then), ("now", results)):
        spread = between_plans(run)
        regrets = [fastest_predicted_regret(r) for r in run]
        lines.append(f"{name}: median step-time error {median_error(run):.1%}; between plans "
                     f"{spread[0]:.1%} (75th percentile {spread[1]:.1%}); the plan predicted "
                     f"fastest of those measured: regret above 3 % in "
                     f"{sum(g > 0.03 for g in regrets)} of {len(regrets)} cases, worst "
                     f"{max(regrets):.1%}")
    return "\n".join(lines)


def read_runs(paths: list[Path], only: list[str] | None) -> list[dict[str, Any]]:
    """The cases of every run in ``paths`` (``only`` those named), one after another."""
    chosen = [r for path in paths for r in read_run(path)
              if only is None or r["case"] in only]
    if not chosen:
        raise SystemExit(f"{', '.join(map(str, paths))}: no case named {', '.join(only or [])}")
    return chosen


def read_run(path: Path) -> list[dict[str, Any]]:
    try:
        results: list[dict[str, Any]] = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{path}: {exc}; give a file fidelity.py --json wrote") from None
    if not isinstance(results, list) or not all("paired" in p for r in results
                                                for p in r.get("plans", [])):
        raise SystemExit(f"{path}: not a fidelity.py --json run with paired launches (the "
                         "fifth session's on)")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+",
                        help="fidelity.py --json files (several: scored as one)")
    parser.add_argument("--only", nargs="*", default=None, help="case names")
    parser.add_argument("--cache", type=Path, default=None,
                        help="pipec's measurement cache to plan from (default: pipec's own)")
    parser.add_argument("--json", type=Path, default=None,
                        help="write the run with the present predictions here")
    parser.add_argument("--margins", nargs="*", type=float, default=[0.0, 2.0, 5.0, 13.0],
                        metavar="PERCENT", help="decision margins to score beside the present")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # as fidelity.py compiles (commands.run)
    if args.cache:
        os.environ["PIPEC_CACHE_DIR"] = str(args.cache)
    results = repredicted(read_runs(args.runs, args.only))
    print(f"\n{summary(results)}\n{margin_lines(results, [m / 100 for m in args.margins])}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
