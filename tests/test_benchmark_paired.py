"""benchmarks/paired.py: the sign test that tells a measured miss from the machine's noise."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from paired import baseline_verdicts, judged, regret_verdict, sign_p, worst


def test_sign_p_is_the_binomial_tail() -> None:
    assert sign_p([0.9] * 6, 1.0) == pytest.approx(1 / 64)
    assert sign_p([0.9] * 5 + [1.1], 1.0) == pytest.approx(7 / 64)
    assert sign_p([1.1, 1.2], 1.0) == 1.0
    assert sign_p([0.9, 0.9], 1.0) == pytest.approx(1 / 4)
    assert sign_p([1.0], 1.0) == 1.0  # a tie is not below


def test_a_median_at_the_threshold_meets_it() -> None:
    assert judged([0.9, 1.0, 1.0, 1.1], 1.0, rounds=2).outcome == "met"


def test_only_the_duel_decides_a_miss() -> None:
    """The rounds' pairs chose to duel the plan: counting them would overstate the evidence."""
    six = judged([0.85, 0.84, 0.84, 0.89, 0.84, 0.84, 0.86, 0.83], 1.0, rounds=2)
    assert (six.outcome, six.below, six.pairs, six.p) == ("missed", 6, 6, pytest.approx(1 / 64))
    four = judged([0.90, 0.89, 0.94, 0.80, 0.88, 0.92], 1.0, rounds=2)
    assert (four.outcome, four.pairs, four.p) == ("within noise", 4, pytest.approx(1 / 16))
    assert four.describe() == "within noise: 0.895, 4 of 4 pairs below, p = 0.062"


def test_a_plan_not_dueled_is_judged_on_its_rounds_and_never_missed() -> None:
    two = judged([0.9, 0.92], 1.0, rounds=2)
    assert (two.outcome, two.below, two.pairs, two.p) == ("within noise", 2, 2, 0.25)


def _plans(rival: list[float], roles: list[str], rounds: int = 2) -> list[dict[str, object]]:
    return [{"roles": ["pipec"], "paired": [1.0] * rounds},
            {"roles": roles, "paired": rival}]


def test_regret_counts_only_what_beats_the_target() -> None:
    # 2 % faster in every pair: a real difference, but within the 3 % regret target.
    assert regret_verdict(_plans([0.98] * 8, ["#2"]), 0.03).outcome == "met"
    # 5 % faster in every pair: regret 5.3 % > 3 %; the 6 duel pairs give p = 1/64.
    missed = regret_verdict(_plans([0.95] * 8, ["#2"]), 0.03)
    assert (missed.outcome, missed.p) == ("missed", pytest.approx(1 / 64))


def test_baselines_are_judged_against_1_and_the_worst_decides() -> None:
    verdicts = baseline_verdicts(_plans([0.98] * 8, ["uniform", "torchgpipe"]),
                                 ("uniform", "torchgpipe"))
    assert set(verdicts) == {"uniform", "torchgpipe"}
    assert worst(list(verdicts.values())).outcome == "missed"
    assert worst([]).outcome == "met"
