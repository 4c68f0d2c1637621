"""benchmarks/fidelity_report.py: a fidelity run's verdicts and figures, from its saved JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from fidelity_report import between_plans, read_results, report, spread, verdict

SAVED_RUN = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "fidelity.json"


def _plan(roles: list[str], predicted_s: float, measured_s: list[float],
          paired: list[float]) -> dict[str, Any]:
    return {"roles": roles, "plan": "2×1, m 8, gpipe", "predicted_s": predicted_s,
            "measured_s": measured_s, "paired": paired}


def test_the_error_between_plans_is_each_plans_ratio_against_the_others_median() -> None:
    # measured ÷ predicted 1.0, 1.1 and 1.3: against the others' medians 1.2, 1.15 and 1.05.
    plans = [_plan(["pipec"], 1.0, [1.0], [1.0]), _plan(["#2"], 1.0, [1.1], [1.1]),
             _plan(["uniform"], 1.0, [1.3], [1.3])]
    deviations = sorted([1 - 1.0 / 1.2, 1 - 1.1 / 1.15, 1.3 / 1.05 - 1])
    median, upper = between_plans([{"plans": plans}])
    assert median == pytest.approx(deviations[1])
    assert upper == pytest.approx((deviations[1] + deviations[2]) / 2)


def test_a_saved_run_is_judged_again_case_by_case(capsys: pytest.CaptureFixture[str]) -> None:
    results = read_results(SAVED_RUN)
    lines = [verdict(r) for r in results]
    assert [line.split(":")[0] for line in lines] == [r["case"] for r in results]
    assert all("regret" in line and "launches spread" in line for line in lines)
    report(results)
    printed = capsys.readouterr().out
    assert f"{len(results)} cases: median step-time error" in printed
    assert "between plans of one model" in printed


def test_a_baseline_measured_faster_is_named_with_its_verdict() -> None:
    pick = _plan(["pipec"], 1.0, [1.0, 1.0], [1.0, 1.0])  # 2 rounds
    rival = _plan(["uniform"], 1.1, [0.9, 0.9], [0.9] * 8)  # and 6 of 6 dueled pairs below
    case = {"case": "toy", "median_error": 0.0, "worst_error": 0.1, "rank_correlation": 1.0,
            "regret": 1 / 0.9 - 1, "pick_vs_baselines": {"uniform": 0.9},
            "pick_spread": spread([1.0, 1.0]), "pick_launches": 2, "plans": [pick, rival]}
    line = verdict(case)
    assert "a baseline measured faster (its step ÷ pipec's): uniform 0.900 (missed" in line
    assert "6 of 6 pairs below" in line
    assert "regret 11.1% (missed" in line


@pytest.mark.parametrize(("content", "message"), [
    ("{}", "not a list of cases"),
    ("[1", "give a file fidelity.py --json wrote"),
    (json.dumps([{"plans": [{"roles": ["pipec"], "measured_s": [1.0]}]}]), "no pairs"),
])
def test_a_file_fidelity_did_not_write_is_refused(tmp_path: Path, content: str,
                                                   message: str) -> None:
    path = tmp_path / "run.json"
    path.write_text(content)
    with pytest.raises(SystemExit, match=message):
        read_results(path)
