"""benchmarks/fidelity.py: which rivals of pipec's pick are dueled, and which duels go on."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from fidelity import Entry, _not_negative, duel, rivals, undecided


def _entry(roles: list[str], paired: list[float], stages: list[int] | None = None) -> Entry:
    return Entry(roles, Path("."), {}, paired=paired, duel_stages=stages or [])


def test_rivals_are_the_plans_beyond_the_regret_target_and_faster_baselines() -> None:
    pick = _entry(["pipec"], [1.0, 1.0])
    close = _entry(["#2"], [0.98, 0.99])  # faster, but within the 3 % target
    far = _entry(["#3"], [0.95, 0.96])
    baseline = _entry(["uniform"], [0.99, 0.995])
    slower = _entry(["conventional"], [1.05, 1.2])
    assert rivals([pick, close, far, baseline, slower]) == [far, baseline]


def test_a_duel_goes_on_only_where_it_left_the_verdict_within_noise() -> None:
    split = _entry(["uniform"], [0.97, 0.98] + [0.98, 1.01] * 3, [6])  # 3 of 6: noise
    clear = _entry(["#2"], [0.9, 0.9] + [0.9] * 6, [6])  # 6 of 6 below the target: missed
    met = _entry(["parameters"], [0.97, 0.98] + [1.02] * 6, [6])  # median above 1
    not_dueled = _entry(["#3"], [0.9, 0.9])  # the rounds alone never decide
    assert undecided([split, clear, met, not_dueled], rounds=2) == [split]
    # A plan that is no baseline is held only to the 3 % regret target.
    close = _entry(["#4"], [0.99, 0.98] + [0.98, 1.01] * 3, [6])
    assert undecided([close], rounds=2) == []


def test_a_negative_count_of_pairs_is_refused() -> None:
    assert _not_negative("0") == 0
    with pytest.raises(argparse.ArgumentTypeError, match="0 or more"):
        _not_negative("-1")


def test_a_duel_of_no_pairs_is_no_stage() -> None:
    """--duels 0: no plan counts as dueled, so none is extended either."""
    pick, rival = _entry(["pipec"], [1.0, 1.0]), _entry(["uniform"], [0.9, 0.9])
    duel(pick, rival, processes=2, steps=10, pairs=0)
    assert rival.duel_stages == [] and undecided([pick, rival], rounds=2) == []
