"""The schedule simulator against the closed forms on balanced stages."""

from __future__ import annotations

import pytest

from pipec.schedule import action_order, in_flight, runs, simulate


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "micro_batches"), [(1, 1), (2, 4), (4, 4), (4, 8), (3, 7)])
def test_balanced_iteration_time_is_closed_form(schedule: str, stages: int,
                                                micro_batches: int) -> None:
    forward, backward = 1.0, 2.0
    result = simulate(schedule, [forward] * stages, [backward] * stages, micro_batches)
    # (M + S − 1)(t_f + t_b) for GPipe and for 1F1B on balanced stages.
    assert result.iteration_s == pytest.approx((micro_batches + stages - 1) * (forward + backward))
    assert result.bubble == pytest.approx((stages - 1) / (micro_batches + stages - 1))


def test_slowest_stage_dominates_the_steady_state() -> None:
    result = simulate("gpipe", [1.0, 3.0], [1.0, 3.0], 10)
    # Fill by the fast stage once, then the slow stage works back to back.
    assert result.iteration_s == pytest.approx(1.0 + 10 * 3.0 + 10 * 3.0 + 1.0)


def test_in_flight_micro_batches() -> None:
    assert in_flight("gpipe", 4, 8) == (8, 8, 8, 8)
    assert in_flight("1f1b", 4, 8) == (4, 3, 2, 1)
    assert in_flight("1f1b", 4, 2) == (2, 2, 2, 1)


def test_1f1b_order_is_warmup_steady_cooldown() -> None:
    order = action_order("1f1b", 0, 3, 4)
    assert order == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2),
                     ("B", 3)]
    assert action_order("1f1b", 2, 3, 4) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2),
                                             ("B", 2), ("F", 3), ("B", 3)]


def test_every_action_runs_once_in_dependency_order() -> None:
    result = simulate("1f1b", [1.0, 2.0, 0.5], [2.0, 1.0, 3.0], 5)
    assert len(result.actions) == 2 * 3 * 5
    end = {(a.kind, a.stage, a.micro_batch): a.end_s for a in result.actions}
    for a in result.actions:
        if a.kind == "F" and a.stage > 0:
            assert a.start_s >= end[("F", a.stage - 1, a.micro_batch)]
        if a.kind == "B" and a.stage < 2:
            assert a.start_s >= end[("B", a.stage + 1, a.micro_batch)]


def test_1f1b_needs_a_micro_batch_per_stage() -> None:
    assert runs("gpipe", 4, 2) and not runs("1f1b", 4, 2) and runs("1f1b", 4, 4)
