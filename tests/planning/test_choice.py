"""pipec.planning.choice: the fastest of the simplest plans within the decision margin."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pipec.planning.choice import choose, simplest_fastest
from pipec.planning.evaluate import Evaluated
from pipec.planning.points import Layout, Point

MARGIN = 0.035  # the second test's three fastest plans lie within it, its simplest beyond


# What the choice reads of the planner's costs: the request (margin, batch) and each plan's
# devices' capacity (whether it fits).
COSTS = SimpleNamespace(request=SimpleNamespace(margin=MARGIN, global_batch=64, calibration=None))
FITS = SimpleNamespace(capacity=(2.0, 2.0))


def _plan(micro_batch: int, schedule: str, virtual: int, step_s: float) -> Evaluated:
    point = Point(Layout(2, 1, virtual, v_shape=schedule == "zbv"), micro_batch, schedule)
    return Evaluated(point, (), FITS, 64 // micro_batch, (1.0, 1.0), (), (), step_s)  # type: ignore[arg-type]


def _within(plans: list[Evaluated]) -> list[Evaluated]:
    fastest = min(p.iteration_s for p in plans)
    return [p for p in plans if p.iteration_s <= fastest * (1 + MARGIN)]


def test_a_simpler_plan_within_the_margin_wins() -> None:
    interleaved = _plan(32, "interleaved", 2, 0.137)
    plain = _plan(32, "1f1b", 1, 0.139)
    assert simplest_fastest(_within([interleaved, plain])) is plain


def test_the_fastest_of_several_simplest_plans_wins() -> None:
    """A ResNet's plans as predicted: ZB-V is fastest; interleaving is simpler than it, and
    1F1B at micro-batch 16 compares neither way with either (no interleaving, but a smaller
    micro-batch). Walking down from ZB-V would stop at interleaving, 2.3 % slower than 1F1B
    at micro-batch 16."""
    zbv = _plan(32, "zbv", 2, 0.1370)
    interleaved = _plan(32, "interleaved", 2, 0.1402)
    smaller = _plan(16, "1f1b", 1, 0.1371)
    plain = _plan(32, "1f1b", 1, 0.1630)  # simpler than all three, but beyond the margin
    plans = [zbv, interleaved, smaller, plain]
    assert simplest_fastest(_within(plans)) is smaller
    assert simplest_fastest(plans) is plain  # with every plan in reach, the simplest of all


def test_the_decision_names_the_fastest_as_runner_up_when_a_simpler_plan_is_kept() -> None:
    zbv = _plan(32, "zbv", 2, 0.1370)
    smaller = _plan(16, "1f1b", 1, 0.1371)
    plans = [zbv, _plan(32, "interleaved", 2, 0.1402), smaller, _plan(32, "1f1b", 1, 0.1630)]
    chosen, decision = choose(COSTS, zbv, plans)  # type: ignore[arg-type]
    assert chosen is smaller and decision.kept_simpler and decision.margin == MARGIN
    assert decision.runner_up is not None
    assert (decision.runner_up.schedule, decision.runner_up.micro_batch) == ("zbv", 32)
    assert decision.runner_up_relative == pytest.approx(0.1370 / 0.1371 - 1)


def test_without_a_simpler_plan_in_reach_the_fastest_wins_and_the_runner_up_is_slower() -> None:
    fastest = _plan(16, "1f1b", 1, 0.1371)
    slower = _plan(32, "1f1b", 1, 0.1630)
    chosen, decision = choose(COSTS, fastest, [fastest, slower])  # type: ignore[arg-type]
    assert chosen is fastest and not decision.kept_simpler
    assert decision.runner_up_relative == pytest.approx(0.1630 / 0.1371 - 1)
