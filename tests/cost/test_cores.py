"""Processes sharing a CPU's cores: the simulation against what shared cores must give."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipec.cost.cores import SharedCores
from pipec.planning.schedules import SCHEDULES, runs
from pipec.planning.simulate import Action, simulate, stage_lower_bound_s


def _stage_times(draw: st.DrawFn, stages: int) -> list[float]:
    return [draw(st.floats(0.1, 5.0)) for _ in range(stages)]


@st.composite
def _pipelines(draw: st.DrawFn) -> tuple[str, int, int, list[float], list[float]]:
    schedule = draw(st.sampled_from(SCHEDULES))
    pp = draw(st.sampled_from([2, 4]))
    virtual = 2 if schedule in ("interleaved", "interleaved-zb", "zbv") else 1
    micro_batches = draw(st.integers(1, 8).filter(lambda m: runs(schedule, pp, m, virtual)))
    stages = pp * virtual
    return schedule, pp, micro_batches, _stage_times(draw, stages), _stage_times(draw, stages)


def test_gpipe_on_one_core_by_hand() -> None:
    # Two processes measured 2× slower side by side: one core between them. Alone, an action
    # takes 1 s (2 contended); together, 2 s each. F0 alone (1), F1 with F0' (2), F1' alone
    # (1), B0' alone (1), B1' with B0 (2), B1 alone (1): 8 s, against 12 s for two devices.
    cores = SharedCores(contention=2.0, processes=2)
    result = simulate("gpipe", [2.0, 2.0], [2.0, 2.0], 2, cores=cores)
    assert result.iteration_s == pytest.approx(8.0)
    assert simulate("gpipe", [2.0, 2.0], [2.0, 2.0], 2).iteration_s == pytest.approx(12.0)


@settings(max_examples=60, deadline=None)
@given(_pipelines())
def test_one_core_is_never_idle(pipeline: tuple[str, int, int, list[float], list[float]]
                                ) -> None:
    """P processes P× slower side by side share one core, which some action always uses: a
    step takes all its work done alone, whatever the schedule."""
    schedule, pp, micro_batches, fwd, bwd = pipeline
    cores = SharedCores(contention=float(pp), processes=pp)
    result = simulate(schedule, fwd, bwd, micro_batches, pp, cores=cores)
    alone = micro_batches * (sum(fwd) + sum(bwd)) / pp
    assert result.iteration_s == pytest.approx(alone, rel=1e-9)


@settings(max_examples=60, deadline=None)
@given(_pipelines(), st.floats(1.0, 4.0), st.sampled_from([1, 2]),
       st.lists(st.floats(0.5, 5.0), max_size=7))
def test_shared_cores_sit_between_the_bound_and_the_plain_simulation(
        pipeline: tuple[str, int, int, list[float], list[float]], contention: float,
        replicas: int, relayed: list[float]) -> None:
    """With or without measured slowdowns (any, even below 1 or above c: they are clamped)."""
    schedule, pp, micro_batches, fwd, bwd = pipeline
    cores = SharedCores(contention, pp * replicas, replicas, tuple(relayed))
    shared = simulate(schedule, fwd, bwd, micro_batches, pp, cores=cores)
    plain = simulate(schedule, fwd, bwd, micro_batches, pp)
    bound = cores.bound_s(stage_lower_bound_s(fwd, bwd, micro_batches, pp, schedule),
                          micro_batches * (sum(fwd) + sum(bwd)) / pp)
    assert bound * (1 - 1e-9) <= shared.iteration_s <= plain.iteration_s * (1 + 1e-9)
    for action in (a for a in shared.actions if a.kind == "F"):  # none faster than alone
        assert action.end_s - action.start_s >= fwd[action.stage] / cores.rate(1) * (1 - 1e-9)


@pytest.mark.parametrize("cores", [SharedCores(1.0, 2), SharedCores(1.8, 2, replicas=2),
                                   SharedCores(2.3, 4, replicas=4)])
def test_without_spare_cores_the_simulation_is_plain(cores: SharedCores) -> None:
    """No contention (a device each), or every process in one pipeline position (data
    parallelism): nothing waits while another computes."""
    fwd, bwd = [1.0, 3.0, 2.0, 1.5], [2.0, 5.0, 4.0, 3.0]
    shared = simulate("1f1b", fwd, bwd, 8, cores=cores)
    assert shared == simulate("1f1b", fwd, bwd, 8)


def test_gpipe_on_one_core_with_a_measured_slowdown_by_hand() -> None:
    # As above, but one process computing alone runs 1.5× its time alone (measured): 1.5 s an
    # action where one computes, 2 where both do: 4 × 1.5 + 2 × 2 = 10 s.
    cores = SharedCores(contention=2.0, processes=2, relayed=(1.5,))
    result = simulate("gpipe", [2.0, 2.0], [2.0, 2.0], 2, cores=cores)
    assert result.iteration_s == pytest.approx(10.0)


def test_measured_slowdowns_are_kept_between_processor_sharing_and_the_contention() -> None:
    # c = 2 on 4 processes: processor sharing says 1, 1, 1.5, 2 with 1 … 4 computing.
    assert [SharedCores(2.0, 4).slowdown(n) for n in range(1, 6)] == [1.0, 1.0, 1.5, 2.0, 2.0]
    # Measured 1.2, 1.1 (below one computing's: kept at 1.2) and 3.0 (above c: 2).
    cores = SharedCores(2.0, 4, relayed=(1.2, 1.1, 3.0))
    assert [cores.slowdown(n) for n in range(1, 5)] == [1.2, 1.2, 2.0, 2.0]
    assert cores.rate(1) == pytest.approx(2.0 / 1.2) and cores.paired == cores.rate(2)
    # Below processor sharing (0.9 alone, 1.0 for three): processor sharing's.
    low = SharedCores(2.0, 4, relayed=(0.9, 1.0, 1.0))
    assert [low.slowdown(n) for n in range(1, 5)] == [1.0, 1.0, 1.5, 2.0]


def test_a_waiting_device_lends_its_core() -> None:
    """Four processes 2.3× slower side by side (4 / 2.3 cores' worth): two computing run 2×
    faster than the contended times, one alone 2.3× (its speed alone); two replicas of a
    two-device pipeline computing at once keep all four processes busy."""
    cores = SharedCores(2.3, 4)
    assert cores.rate(4) == pytest.approx(1.0)
    assert cores.rate(2) == pytest.approx(2.0)
    assert cores.rate(1) == pytest.approx(2.3)
    assert SharedCores(2.3, 4, replicas=2).rate(2) == pytest.approx(1.0)
    # The probe's links and runtime, measured with two of the four computing: 2× faster than
    # when all four compute; with two processes, both computed.
    assert cores.paired == pytest.approx(2.0)
    assert SharedCores(1.2, 2).paired == pytest.approx(1.0)


@settings(max_examples=60, deadline=None)
@given(_pipelines(), st.floats(0.0, 2.0), st.sampled_from([1.0, 2.0]))
def test_a_late_receive_starts_no_earlier_than_its_post_and_the_wait(
        pipeline: tuple[str, int, int, list[float], list[float]], late: float,
        contention: float) -> None:
    """Plain or on shared cores: an action starts after its device's previous one and its
    inputs' ends, and an input from another device that ended before its receiver was free
    arrives ``late`` after it was; the bounds still hold."""
    schedule, pp, micro_batches, fwd, bwd = pipeline
    cores = SharedCores(contention, pp)
    result = simulate(schedule, fwd, bwd, micro_batches, pp, cores=cores, late_receive_s=late)
    ends = {(a.kind, a.stage, a.micro_batch): (a.end_s, a.device) for a in result.actions}
    for device in range(pp):
        free = 0.0
        for action in (a for a in result.actions if a.device == device):
            assert action.start_s >= free - 1e-9
            for end, sender in _inputs(action, ends, len(fwd)):
                late_here = sender != device and end <= free
                assert action.start_s >= (free + late if late_here else end) - 1e-9
            free = action.end_s
    bound = cores.bound_s(stage_lower_bound_s(fwd, bwd, micro_batches, pp, schedule),
                          micro_batches * (sum(fwd) + sum(bwd)) / pp)
    assert bound * (1 - 1e-9) <= result.iteration_s


def _inputs(action: Action, ends: dict[tuple[str, int, int], tuple[float, int]],
            stages: int) -> list[tuple[float, int]]:
    """The (end, device) of the actions of other stages ``action`` waits for."""
    k, s = action.micro_batch, action.stage
    if action.kind == "F":
        return [ends["F", s - 1, k]] if s > 0 else []
    if action.kind in ("B", "I") and s < stages - 1:
        return [ends.get(("B", s + 1, k)) or ends["I", s + 1, k]]
    return []
