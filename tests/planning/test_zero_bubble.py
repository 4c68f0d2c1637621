"""The zero-bubble schedules: torch's own orders, their dependencies, memory and bubble."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.pipelining.schedules import (
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from pipec.planning.schedules import action_order, in_flight, runs, stage_device
from pipec.planning.simulate import lower_bound_s, simulate, stage_lower_bound_s

KINDS = {"FORWARD": "F", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W", "FULL_BACKWARD": "B"}


def _torch_order(schedule: type, device: int, pp: int, micro_batches: int,
                 virtual: int) -> list[tuple]:
    """torch's own action list for one rank, computed without a process group."""
    rounds = max(1, micro_batches // pp)
    fake = SimpleNamespace(n_local_stages=virtual, pp_group_size=pp, _n_microbatches=micro_batches,
                           microbatches_per_round=micro_batches // rounds, rank=device,
                           num_stages=pp * virtual)
    actions = schedule._calculate_single_rank_operations(fake, device)  # type: ignore[attr-defined]
    return [(KINDS[a.computation_type.name], a.stage_index, a.microbatch_index)
            for a in actions if a is not None]


@pytest.mark.parametrize(("pp", "micro_batches", "virtual"),
                         [(2, 2, 2), (2, 4, 2), (4, 4, 2), (4, 8, 3), (3, 6, 2), (2, 8, 4)])
def test_interleaved_zero_bubble_order_is_torchs(pp: int, micro_batches: int,
                                                 virtual: int) -> None:
    for device in range(pp):
        assert action_order("interleaved-zb", device, pp, micro_batches, virtual) == \
            _torch_order(ScheduleInterleavedZeroBubble, device, pp, micro_batches, virtual)


@pytest.mark.parametrize(("pp", "micro_batches"), [(2, 1), (2, 3), (2, 8), (3, 4), (4, 7),
                                                   (4, 12)])
def test_zbv_order_is_torchs(pp: int, micro_batches: int) -> None:
    for device in range(pp):
        assert action_order("zbv", device, pp, micro_batches, 2) == \
            _torch_order(ScheduleZBVZeroBubble, device, pp, micro_batches, 2)


def test_zbv_puts_two_stages_per_device_in_a_v() -> None:
    assert [stage_device("zbv", k, 3) for k in range(6)] == [0, 1, 2, 2, 1, 0]
    assert [stage_device("interleaved-zb", k, 3) for k in range(6)] == [0, 1, 2, 0, 1, 2]
    assert runs("zbv", 2, 1, 2) and not runs("zbv", 2, 4, 3) and not runs("zbv", 1, 4, 2)
    assert runs("interleaved-zb", 2, 4, 2) and not runs("interleaved-zb", 2, 3, 2)


@pytest.mark.parametrize(("schedule", "pp", "micro_batches", "virtual"),
                         [("zbv", 3, 5, 2), ("interleaved-zb", 2, 4, 3)])
def test_every_action_runs_once_after_what_it_needs(schedule: str, pp: int,
                                                    micro_batches: int, virtual: int) -> None:
    stages = pp * virtual
    result = simulate(schedule, [1.0, 0.5, 2.0, 1.5, 1.0, 0.7][:stages],
                      [2.0, 1.0, 3.0, 2.5, 1.0, 2.0][:stages], micro_batches, pp)
    assert len(result.actions) == 3 * stages * micro_batches
    # Starts are computed as end − duration: allow for its rounding.
    end = {(a.kind, a.stage, a.micro_batch): a.end_s - 1e-9 for a in result.actions}
    for a in result.actions:
        assert a.device == stage_device(schedule, a.stage, pp)
        if a.kind == "F" and a.stage > 0:
            assert a.start_s >= end["F", a.stage - 1, a.micro_batch]
        if a.kind == "I":
            assert a.start_s >= end["F", a.stage, a.micro_batch]
            if a.stage < stages - 1:
                assert a.start_s >= end["I", a.stage + 1, a.micro_batch]
        if a.kind == "W":
            assert a.start_s >= end["I", a.stage, a.micro_batch]


def test_zbv_holds_what_1f1b_holds_and_a_half() -> None:
    # ZB-V (Qi et al. 2024, section 6): each device's two half-size stages hold 2·pp + 1
    # micro-batches' activations at most (a stage keeps them until its weights' gradient), as
    # much as 1F1B's first stage (pp full ones) and half a stage more.
    pp, micro_batches = 4, 12
    held = in_flight("zbv", pp, micro_batches, 2)
    for device in range(pp):
        assert held[device] + held[2 * pp - 1 - device] == 2 * pp + 1
    assert in_flight("1f1b", pp, micro_batches)[0] == pp


@pytest.mark.parametrize(("pp", "micro_batches"), [(2, 4), (4, 8), (4, 16)])
def test_zero_bubble_idles_less_than_interleaving_and_1f1b(pp: int, micro_batches: int) -> None:
    # Balanced stages, the backward twice the forward and half of it the weights' gradient.
    one = simulate("1f1b", [1.0] * pp, [2.0] * pp, micro_batches)
    halves = ([0.5] * 2 * pp, [1.0] * 2 * pp, micro_batches, pp)
    interleaved = simulate("interleaved", *halves)
    zb = simulate("interleaved-zb", *halves)
    zbv = simulate("zbv", *halves)
    assert zbv.bubble < interleaved.bubble < one.bubble
    assert zb.bubble < interleaved.bubble
    assert zbv.iteration_s >= micro_batches * 3.0  # no device works faster than its work


@st.composite
def pipelines(draw: st.DrawFn) -> tuple:
    schedule = draw(st.sampled_from(["interleaved-zb", "zbv"]))
    pp = draw(st.integers(2, 5))
    virtual = 2 if schedule == "zbv" else draw(st.integers(2, 3))
    micro_batches = pp * draw(st.integers(1, 3)) if schedule != "zbv" else \
        draw(st.integers(1, 9))
    times = st.lists(st.floats(0.0, 5.0), min_size=pp * virtual, max_size=pp * virtual)
    shares = st.lists(st.floats(0.0, 1.0), min_size=pp * virtual, max_size=pp * virtual)
    backward = draw(times)
    weights = [b * s for b, s in zip(backward, draw(shares), strict=True)]
    return schedule, pp, micro_batches, draw(times), backward, weights


@settings(max_examples=200, deadline=None)
@given(pipelines())
def test_lower_bounds_hold_under_zero_bubble(case: tuple) -> None:
    # The planner prunes candidates with these bounds: they must never exceed a simulated time.
    schedule, pp, micro_batches, forward, backward, weights = case
    result = simulate(schedule, forward, backward, micro_batches, pp, weight_s=weights)
    chain = sum(forward) + sum(b - w for b, w in zip(backward, weights, strict=True))
    bound = lower_bound_s(sum(forward) + sum(backward), pp, micro_batches, len(forward) // pp,
                          schedule, chain)
    assert bound <= result.iteration_s * (1 + 1e-9) + 1e-12
    bound = stage_lower_bound_s(forward, backward, micro_batches, pp, schedule)
    assert bound <= result.iteration_s * (1 + 1e-9) + 1e-12
