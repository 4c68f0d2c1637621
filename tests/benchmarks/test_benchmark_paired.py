"""benchmarks/paired.py: the sign test that tells a measured miss from the machine's noise."""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from paired import baseline_verdicts, judged, regret_verdict, sign_p, staged_sign_p, worst


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


def test_one_stage_is_the_plain_sign_test() -> None:
    pairs = [0.9, 0.95, 1.1, 0.97, 0.92, 1.01]
    assert staged_sign_p(pairs, 1.0, [6]) == (pytest.approx(sign_p(pairs, 1.0)), 6)


def _staged(first: int, second: int) -> list[float]:
    """6 pairs, then 10, with ``first`` and ``second`` of them below 1."""
    return ([0.9] * first + [1.1] * (6 - first)) + ([0.9] * second + [1.1] * (10 - second))


def _wrong_misses(first: int, second: int, test: Callable[[list[float], list[int]], float]
                  ) -> float:
    """The exact chance of a verdict "missed" for a plan truly at the threshold (every pair a
    fair coin): ``first`` pairs, then ``second`` more only where the first look did not
    reject, as fidelity.py runs a duel."""
    wrong = 0.0
    for below_1, below_2 in itertools.product(range(first + 1), range(second + 1)):
        look = [0.9] * below_1 + [1.1] * (first - below_1)
        if sign_p(look, 1.0) <= 0.05:  # stops at the first look
            wrong += math.comb(first, below_1) / 2 ** first if below_2 == 0 else 0.0
            continue
        pairs = look + [0.9] * below_2 + [1.1] * (second - below_2)
        if test(pairs, [first, second]) <= 0.05:
            wrong += math.comb(first, below_1) * math.comb(second, below_2) / 2 ** (first + second)
    return wrong


def test_two_looks_still_err_at_most_5_percent_on_a_fair_coin() -> None:
    def staged(pairs: list[float], stages: list[int]) -> float:
        return staged_sign_p(pairs, 1.0, stages)[0]
    def as_one(pairs: list[float], stages: list[int]) -> float:
        return sign_p(pairs, 1.0)
    assert 0.04 < _wrong_misses(6, 10, staged) <= 0.05  # fidelity.py's defaults
    assert _wrong_misses(8, 8, staged) <= 0.05
    # Counting 8 then 8 pairs as one sample of 16 would err 6.0 % of the time.
    assert _wrong_misses(8, 8, as_one) > 0.05


def test_a_second_stage_needs_12_of_16_below() -> None:
    assert staged_sign_p(_staged(5, 7), 1.0, [6, 10]) == (pytest.approx(0.0481, abs=1e-4), 16)
    assert staged_sign_p(_staged(5, 6), 1.0, [6, 10])[0] > 0.05
    verdict = judged([0.9, 0.9, *_staged(5, 7)], 1.0, rounds=2, stages=[6, 10])
    assert (verdict.outcome, verdict.below, verdict.pairs) == ("missed", 12, 16)
    # Counted as one sample of 16 it would have looked surer than it is.
    assert sign_p(_staged(5, 7), 1.0) < verdict.p


def test_a_look_that_rejects_decides() -> None:
    """A baseline 6 of 6 below 1 is missed at the first look; pairs run afterwards for its regret
    verdict (within noise at 0.971) do not turn it into "met"."""
    first = [0.99, 0.98, 0.985, 0.99, 0.98, 0.99]
    verdict = judged([0.99, 0.99, *first, *[1.02] * 10], 1.0, rounds=2, stages=[6, 10])
    assert (verdict.outcome, verdict.below, verdict.pairs) == ("missed", 6, 6)
    assert verdict.p == pytest.approx(1 / 64)


def test_stages_must_match_the_pairs() -> None:
    """A saved run that recorded no stages counts as one stage."""
    pairs = [0.9, 0.9] + [0.9] * 6
    assert judged(pairs, 1.0, 2, None).p == judged(pairs, 1.0, 2, []).p == pytest.approx(1 / 64)
    with pytest.raises(ValueError, match=r"\[3\] do not add up to the 6 pairs"):
        judged(pairs, 1.0, 2, [3])
