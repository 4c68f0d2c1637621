"""The schedule simulator against the closed forms on balanced stages."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

from pipec.planning.schedules import action_order, awaiting_weights, in_flight, order_changes, runs
from pipec.planning.simulate import lower_bound_s, simulate, stage_lower_bound_s


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
    order = [(kind, k) for kind, _, k in action_order("1f1b", 0, 3, 4)]
    assert order == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2),
                     ("B", 3)]
    order = [(kind, k) for kind, _, k in action_order("1f1b", 2, 3, 4)]
    assert order == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3),
                     ("B", 3)]


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


def _torch_order(device: int, pp: int, micro_batches: int, virtual: int) -> list[tuple]:
    """torch's own action list for one rank, computed without a process group."""
    rounds = max(1, micro_batches // pp)
    fake = SimpleNamespace(n_local_stages=virtual, pp_group_size=pp, _n_microbatches=micro_batches,
                           microbatches_per_round=micro_batches // rounds)
    actions = ScheduleInterleaved1F1B._calculate_single_rank_operations(fake, device)  # type: ignore[arg-type]
    return [("F" if a.computation_type.name == "FORWARD" else "B", a.stage_index,
             a.microbatch_index) for a in actions if a is not None]


@pytest.mark.parametrize(("pp", "micro_batches", "virtual"),
                         [(2, 2, 2), (2, 4, 2), (4, 4, 2), (4, 8, 3), (3, 6, 2), (2, 8, 4)])
def test_interleaved_order_is_torchs(pp: int, micro_batches: int, virtual: int) -> None:
    for device in range(pp):
        ours = action_order("interleaved", device, pp, micro_batches, virtual)
        assert ours == _torch_order(device, pp, micro_batches, virtual)


@pytest.mark.parametrize(("pp", "micro_batches", "virtual"), [(2, 4, 2), (4, 8, 2), (4, 4, 4)])
def test_interleaved_bubble_shrinks_by_the_stages_per_device(pp: int, micro_batches: int,
                                                             virtual: int) -> None:
    # Each device's work t_f + t_b split into v equal stages: the bubble is (pp − 1) / (v·M)
    # of the ideal time (Narayanan et al. 2021, section 2.2).
    forward, backward = 1.0 / virtual, 2.0 / virtual
    stages = pp * virtual
    result = simulate("interleaved", [forward] * stages, [backward] * stages, micro_batches, pp)
    ideal = micro_batches * 3.0
    assert result.iteration_s == pytest.approx(ideal * (1 + (pp - 1) / (virtual * micro_batches)))
    gpipe = simulate("gpipe", [3.0 / 2] * pp, [3.0] * pp, micro_batches)
    assert result.bubble < gpipe.bubble
    assert len(result.actions) == 2 * stages * micro_batches


@pytest.mark.parametrize(("pp", "micro_batches", "virtual"),
                         [(2, 2, 2), (2, 4, 2), (4, 4, 2), (4, 8, 3), (3, 6, 2), (2, 8, 4)])
def test_interleaved_in_flight_counts_the_order(pp: int, micro_batches: int,
                                                virtual: int) -> None:
    peaks = [0] * (pp * virtual)
    for device in range(pp):
        held = [0] * (pp * virtual)
        for kind, stage, _ in action_order("interleaved", device, pp, micro_batches, virtual):
            held[stage] += 1 if kind == "F" else -1
            peaks[stage] = max(peaks[stage], held[stage])
    assert in_flight("interleaved", pp, micro_batches, virtual) == tuple(peaks)


def test_interleaved_in_flight_and_when_it_runs() -> None:
    # pp 2, v 2, M 4. Device 0 warms up with F0 F1 on stage 0, F0 F1 on stage 2, then runs
    # stage 0's F2 and F3 before stage 0's first backward: 4 held. Device 1 warms up with F0 F1
    # on stage 1, then stage 3 runs F-B pairs (1 held) before stage 1's F2 and first B (3 held).
    assert in_flight("interleaved", 2, 4, 2) == (4, 3, 2, 1)
    assert runs("interleaved", 2, 4, 2) and not runs("interleaved", 2, 3, 2)
    assert not runs("interleaved", 1, 4, 2) and not runs("interleaved", 2, 4, 1)
    assert not runs("1f1b", 2, 4, 2)


@st.composite
def pipelines(draw: st.DrawFn) -> tuple[str, int, int, list[float], list[float]]:
    schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved"]))
    pp = draw(st.integers(2 if schedule == "interleaved" else 1, 5))
    virtual = draw(st.integers(2, 3)) if schedule == "interleaved" else 1
    if schedule == "interleaved":
        micro_batches = pp * draw(st.integers(1, 3))
    else:
        micro_batches = draw(st.integers(pp if schedule == "1f1b" else 1, 9))
    times = st.lists(st.floats(0.0, 5.0), min_size=pp * virtual, max_size=pp * virtual)
    return schedule, pp, micro_batches, draw(times), draw(times)


@settings(max_examples=200, deadline=None)
@given(pipelines())
def test_lower_bound_holds_for_any_stage_times(case: tuple) -> None:
    # The planner prunes candidates with this bound: it must never exceed a simulated time.
    schedule, pp, micro_batches, forward, backward = case
    result = simulate(schedule, forward, backward, micro_batches, pp)
    bound = lower_bound_s(sum(forward) + sum(backward), pp, micro_batches,
                          len(forward) // pp)
    assert bound <= result.iteration_s * (1 + 1e-9) + 1e-12
    bound = stage_lower_bound_s(forward, backward, micro_batches, pp)
    assert bound <= result.iteration_s * (1 + 1e-9) + 1e-12


def test_lower_bound_is_close_on_balanced_stages() -> None:
    # 8 balanced stages, 8 micro-batches: the closed form is 15/8 W, the bound 1/(1 − (7/8)^8) W.
    assert lower_bound_s(1.0, 8, 8) == pytest.approx(1 / (1 - (7 / 8) ** 8))
    assert simulate("gpipe", [0.5 / 8] * 8, [0.5 / 8] * 8, 8).iteration_s == pytest.approx(15 / 8)


@pytest.mark.parametrize(("schedule", "pp", "micro_batches", "virtual"),
                         [("gpipe", 4, 6, 1), ("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2),
                          ("interleaved", 2, 4, 3)])
def test_stage_bound_is_the_closed_form_on_balanced_stages(schedule: str, pp: int,
                                                           micro_batches: int,
                                                           virtual: int) -> None:
    stages = pp * virtual
    forward, backward = [1.0 / stages] * stages, [2.0 / stages] * stages
    simulated = simulate(schedule, forward, backward, micro_batches, pp).iteration_s
    assert stage_lower_bound_s(forward, backward, micro_batches, pp) == pytest.approx(simulated)


@pytest.mark.parametrize(("schedule", "pp", "micro_batches", "expected"), [
    ("interleaved-zb", 2, 2, (1, 2, 1, 2)), ("zbv", 2, 4, (1, 2, 1, 1)),
    ("1f1b", 2, 4, (0, 0, 0, 0)), ("interleaved", 2, 4, (0, 0, 0, 0))])
def test_awaiting_weights_counted_over_the_order(schedule: str, pp: int, micro_batches: int,
                                                  expected: tuple[int, ...]) -> None:
    """Counted over torch's orders: the most micro-batches whose input gradient ran and whose
    weights' has not; none where the backward is not split."""
    assert awaiting_weights(schedule, pp, micro_batches, 2) == expected


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(("interleaved-zb", "zbv")), st.sampled_from((2, 4)),
       st.integers(1, 4))
def test_a_micro_batch_awaiting_its_weights_is_in_flight(schedule: str, pp: int,
                                                        rounds: int) -> None:
    flights = in_flight(schedule, pp, pp * rounds, 2)
    awaiting = awaiting_weights(schedule, pp, pp * rounds, 2)
    assert all(0 <= w <= f for w, f in zip(awaiting, flights, strict=True))


@pytest.mark.parametrize(("pp", "micro_batches", "virtual"), [(2, 2, 2), (4, 8, 3), (8, 16, 4)])
def test_interleaved_changes_are_its_orders(pp: int, micro_batches: int, virtual: int) -> None:
    """The vectorized arrays the memory walk reads are the order, action by action."""
    for device, (stages, held, awaiting) in enumerate(
            order_changes("interleaved", pp, micro_batches, virtual)):
        order = action_order("interleaved", device, pp, micro_batches, virtual)
        assert stages.tolist() == [stage for _, stage, _ in order]
        assert held.tolist() == [1 if kind == "F" else -1 for kind, _, _ in order]
        assert not awaiting.any()


def test_a_late_receive_waits_after_its_post_by_hand() -> None:
    """Two stages, GPipe, 3 micro-batches, forward 1 s, backward 2, 0.5 s per late receive.
    Stage 1's forward k asks for its input when its forward k − 1 ends (1, 2.5, 4) and gets it
    at stage 0's end if that is later (1), else 0.5 s after asking (2.5, 4); its backwards
    need nothing sent (5 to 11). Stage 0's backwards ask at 3, 9 and 11.5: 7, 9.5 and 12."""
    result = simulate("gpipe", [1.0, 1.0], [2.0, 2.0], 3, late_receive_s=0.5)
    starts = {(a.kind, a.stage, a.micro_batch): a.start_s for a in result.actions}
    assert [starts["F", 1, k] for k in range(3)] == [1.0, 2.5, 4.0]
    assert [starts["B", 0, k] for k in range(3)] == [7.0, 9.5, 12.0]
    assert result.iteration_s == 14.0
    assert simulate("gpipe", [1.0, 1.0], [2.0, 2.0], 3).iteration_s == 12.0


def test_a_transfer_holds_the_link_not_the_sender_by_hand() -> None:
    """Two stages, GPipe, 2 micro-batches of 1 s forward and backward, 0.5 s on the link each
    way. Stage 0 sends and goes on (its forwards end at 1 and 2). Stage 1's first input
    arrives at 1.5 (forward 1.5–2.5); it asks for the second at 2.5, after it was sent, so the
    transfer starts then (forward 3–4); backwards 4–5 and 5–6. Stage 0 asks for the first
    gradient at 2, before it is sent: 5.5; for the second at 6.5, after: 7; so 8 in all."""
    result = simulate("gpipe", [1.0, 1.0], [1.0, 1.0], 2, transfer_s=([0.5, 0.0], [0.0, 0.5]))
    starts = {(a.kind, a.stage, a.micro_batch): a.start_s for a in result.actions}
    assert [starts["F", 0, k] for k in range(2)] == [0.0, 1.0]
    assert [starts["F", 1, k] for k in range(2)] == [1.5, 3.0]
    assert [starts["B", 0, k] for k in range(2)] == [5.5, 7.0]
    assert result.iteration_s == 8.0


def test_a_late_receive_starts_the_transfer_when_it_asks_by_hand() -> None:
    """As above, 3 micro-batches, 0.5 s per late receive and 0.25 s on the link forward:
    stage 1's forward k asks when its forward k − 1 ends; input 0 arrives 0.25 after stage 0's
    forward (1.25), inputs 1 and 2 were sent before the ask (2 < 2.25, 3 < 3.25), so each
    arrives 0.5 + 0.25 after it (3.0, then 4.75)."""
    result = simulate("gpipe", [1.0, 1.0], [1.0, 1.0], 3, late_receive_s=0.5,
                      transfer_s=([0.25, 0.0], [0.0, 0.0]))
    starts = {(a.kind, a.stage, a.micro_batch): a.start_s for a in result.actions}
    assert [starts["F", 1, k] for k in range(3)] == [1.25, 3.0, 4.75]
