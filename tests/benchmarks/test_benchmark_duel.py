"""benchmarks/studies/duel.py: two compiled plans launched in turns, and the sign test on their
pairs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "studies"))
from duel import processes, verdict


def test_a_lopsided_duel_is_tested_on_both_sides() -> None:
    # 9 of 10 pairs one way: P(≥ 9 of 10) = 11/1024, doubled for either side.
    assert verdict([0.9] * 9 + [1.1]).endswith(f"9 below 1, 1 above; two-sided sign test p = "
                                               f"{22 / 1024:.3f}")
    assert verdict([1.1] * 9 + [0.9]).endswith(f"p = {22 / 1024:.3f}")
    # An even split is no evidence either way.
    assert verdict([0.9, 1.1] * 5).endswith("5 below 1, 5 above; two-sided sign test p = 1.000")
    assert verdict([0.888, 1.084, 1.002]).startswith("A ÷ B: median 1.002 over 3 pairs "
                                                     "(0.888–1.084)")


def test_a_plan_counts_its_processes_and_a_directory_without_one_is_refused(
        tmp_path: Path) -> None:
    (tmp_path / "plan.json").write_text(json.dumps({"pp": 2, "dp": 2}))
    assert processes(tmp_path) == 4
    with pytest.raises(SystemExit, match=r"no readable plan\.json"):
        processes(tmp_path / "missing")
    (tmp_path / "plan.json").write_text(json.dumps({"pp": 2}))  # not pipec's: no dp
    with pytest.raises(SystemExit, match=r"no readable plan\.json"):
        processes(tmp_path)
