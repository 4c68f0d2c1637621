"""pipec.calibration.runtime_fit: the runtime probe's measurements fitted to the cost model's
terms, each fit checked by reproducing the steps it was fitted to."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, replace

import pytest

from pipec.calibration.action_times import SCHEDULE_MICRO_BATCHES
from pipec.calibration.allreduce_times import (
    DATA_PARALLEL_SHAPES,
    data_parallel_bytes,
    data_parallel_tensors,
)
from pipec.calibration.by_default import _with_runtime
from pipec.calibration.probe import RuntimeFigures
from pipec.calibration.runtime_fit import (
    blocking_fit,
    data_parallel_fit,
    probe_cuts,
    runtime_action_fit,
)
from pipec.cost.hardware import PRESETS
from pipec.cost.model import allreduce_s, data_parallel_collectives
from pipec.planning.schedules import SCHEDULES, stage_device
from pipec.planning.simulate import simulate

UNMEASURED = ((0.0, 0.0),) * len(DATA_PARALLEL_SHAPES)  # the data-parallel steps, not probed


def test_the_blocking_fit_goes_through_both_measured_points() -> None:
    # 1 ms + 20 ms/√s × √T at T = 1 and 16 ms of compute between two all-reduces.
    def extra(compute_s: float) -> float:
        return 1e-3 + 0.02 * math.sqrt(compute_s)

    blocking = ((1e-3, extra(1e-3)), (16e-3, extra(16e-3)))
    runtime = RuntimeFigures(2, 0.0, 1e30, 0.0, 1e9, 0.0, {}, 0.0, UNMEASURED, 0.0, blocking)
    assert blocking_fit(runtime) == pytest.approx((1e-3, 0.02))
    # Nothing measured (one process), or less after more compute (noise): no drift.
    assert blocking_fit(replace(runtime, blocking_s=())) == (0.0, 0.0)
    noisy = ((1e-3, 2e-3), (16e-3, 1.5e-3))
    assert blocking_fit(replace(runtime, blocking_s=noisy)) == (2e-3, 0.0)


def test_the_data_parallel_fit_reproduces_the_three_measured_steps() -> None:
    # 4 processes on a machine where a data-parallel step adds the ring's 6 latencies of
    # 100 µs, 1.5 × its bytes at 1 GB/s, the loss's all-reduce charged at 0.3 ms already (step
    # overhead), 0.5 ms per all-reduce, 20 µs per gradient tensor and the lead of 20 ms/√s ×
    # √T after T of compute (the blocking probe's drift): the small models' 1 bucket and the
    # loss's are 2 all-reduces, the 4 MiB model's 2 buckets (1 MiB, then the rest) and the
    # loss's 3.
    nbytes = [data_parallel_bytes(*shape) for shape in DATA_PARALLEL_SHAPES]
    tensors = [data_parallel_tensors(layers) for _, layers in DATA_PARALLEL_SHAPES]
    assert [data_parallel_collectives(b) for b in nbytes] == [2, 3, 2] and tensors == [8, 8, 96]
    compute = (1e-3, 2e-3, 4e-3)

    def added(nbytes: int, tensors: int, compute_s: float) -> float:
        return 0.3e-3 + 6 * 100e-6 + data_parallel_collectives(nbytes) * 0.5e-3 \
            + 1.5 * nbytes / 1e9 + tensors * 20e-6 + 0.02 * math.sqrt(compute_s)

    blocking = ((1e-3, 1e-3 + 0.02 * math.sqrt(1e-3)), (16e-3, 1e-3 + 0.02 * math.sqrt(16e-3)))
    runtime = RuntimeFigures(4, 100e-6, 1e30, 0.0, 5e9, 0.3e-3, {}, 0.0,
                             tuple(zip(compute, map(added, nbytes, tensors, compute),
                                       strict=True)), 0.0, blocking)
    collective, bandwidth, per_tensor = data_parallel_fit(runtime)
    # The bandwidth is the step's, not the probe's lone all-reduce's 5 GB/s.
    assert collective == pytest.approx(0.5e-3) and bandwidth == pytest.approx(1e9)
    assert per_tensor == pytest.approx(20e-6)
    device = replace(PRESETS["cpu"], intra_node_latency_s=100e-6, allreduce_bandwidth=bandwidth,
                     step_collective_s=collective, gradient_tensor_s=per_tensor)
    for size, count, compute_s in zip(nbytes, tensors, compute, strict=True):
        model = 0.3e-3 + allreduce_s(size, 4, device) + data_parallel_collectives(size) \
            * collective + count * per_tensor + blocking_fit(runtime)[1] * math.sqrt(compute_s)
        assert model == pytest.approx(added(size, count, compute_s), rel=1e-6)
    # Steps that do not grow with the bytes or the tensors (noise), no drift: the all-reduce's
    # own bandwidth, next to nothing per tensor (the many tensors' 3 KiB fewer bytes).
    flat = data_parallel_fit(replace(runtime, blocking_s=(),
                                     data_parallel_s=((0.0, added(nbytes[0], 8, 0.0)),) * 3))
    assert flat[1] == 5e9 and flat[2] < 1e-7


def _group_steps(replicas: int, wait: float, per_tensor: float
                 ) -> tuple[tuple[float, float], ...]:
    """The data-parallel probe's three steps on ``replicas`` processes of a machine whose ring
    pays 100 µs per latency and 1 GB/s on its bus, the loss's all-reduce 0.3 ms (the step
    overhead), each all-reduce ``wait`` and each tensor ``per_tensor``; no drift."""
    nbytes = [data_parallel_bytes(*shape) for shape in DATA_PARALLEL_SHAPES]
    tensors = [data_parallel_tensors(layers) for _, layers in DATA_PARALLEL_SHAPES]
    ring = 2 * (replicas - 1)
    return tuple((1e-3, 0.3e-3 + ring * 100e-6 + data_parallel_collectives(b) * wait
                  + ring / replicas * b / 1e9 + t * per_tensor)
                 for b, t in zip(nbytes, tensors, strict=True))


def test_a_smaller_groups_fit_takes_its_own_ring_and_steps() -> None:
    """4 processes whose all-reduces wait 0.5 ms and 20 µs per tensor on all 4, but 0.2 ms and
    8 µs on 2 of them while the other 2 wait: each fit finds its own group's, through its own
    ring (6 latencies and 1.5 × the bytes on 4; 2 and 1 × on 2)."""
    runtime = RuntimeFigures(4, 100e-6, 1e30, 0.0, 5e9, 0.3e-3, {}, 0.0,
                             _group_steps(4, 0.5e-3, 20e-6), 0.0, (),
                             group_data_parallel_s=((2, _group_steps(2, 0.2e-3, 8e-6)),))
    assert data_parallel_fit(runtime) == pytest.approx((0.5e-3, 1e9, 20e-6), rel=1e-5)
    assert data_parallel_fit(runtime, 2) == pytest.approx((0.2e-3, 1e9, 8e-6), rel=1e-5)
    # The measured device carries the group's fit beside the every-process figures, also from
    # the cache's JSON (lists for tuples).
    device = _with_runtime(PRESETS["cpu"], runtime)
    cached = RuntimeFigures(**json.loads(json.dumps(asdict(runtime))))
    assert _with_runtime(PRESETS["cpu"], cached) == device
    assert device.replica_collectives == ((2, *data_parallel_fit(runtime, 2)),)
    assert (device.step_collective_s, device.gradient_tensor_s) == pytest.approx((0.5e-3, 20e-6),
                                                                                rel=1e-5)


def _probe_steps(action: float, post: float, link: float) -> dict[str, float]:
    """Every schedule's probe step for a runtime that takes ``action`` per action and ``post``
    per send or receive to the other device, ``link`` on the link for each crossing,
    simulated here from the probe's layout."""
    steps = {}
    for schedule in SCHEDULES:
        stages = 2 if schedule in ("gpipe", "1f1b") else 4
        devices = [stage_device(schedule, k, 2) for k in range(stages)]
        crossing = [a != b for a, b in itertools.pairwise(devices)] + [False]
        posts = [int(k > 0 and crossing[k - 1]) + int(crossing[k]) for k in range(stages)]
        forward = [action + post * n for n in posts]
        sent = [link * c for c in crossing]
        split = schedule in ("interleaved-zb", "zbv")
        backward = [f + action for f in forward] if split else forward
        steps[schedule] = simulate(schedule, forward, backward, SCHEDULE_MICRO_BATCHES, 2,
                                   weight_s=[action] * stages if split else None,
                                   transfer_s=(sent, [0.0, *sent[:-1]])).iteration_s
    return steps


def test_the_runtime_fit_finds_the_time_per_action_and_per_post() -> None:
    link = 150e-6
    steps = _probe_steps(140e-6, 310e-6, link)
    # ZB-V's turn is in place: 2 of its 3 boundaries cross; a loop's all do.
    assert probe_cuts("zbv", 4, link).count(link) == 2
    assert probe_cuts("interleaved", 4, link).count(link) == 3
    runtime = RuntimeFigures(2, link, 1e30, 50e-6, 1e9, 1e-4, steps, 0.0, UNMEASURED, 0.0, ())
    assert runtime_action_fit(runtime) == pytest.approx((140e-6, 310e-6), rel=1e-4)
    # Steps the links alone explain leave nothing to the runtime; none measured, nothing.
    fast = replace(runtime, schedule_step_s=dict.fromkeys(steps, 1e-6))
    assert runtime_action_fit(fast) == (0.0, 0.0)
    assert runtime_action_fit(replace(runtime, schedule_step_s={})) == (0.0, 0.0)


def test_every_schedule_is_fitted_with_one_time_per_action() -> None:
    steps = {**_probe_steps(100e-6, 0.0, 0.0), "gpipe": 1.0}  # GPipe's step far off
    runtime = RuntimeFigures(2, 0.0, 1e30, 50e-6, 1e9, 1e-4, steps, 0.0, UNMEASURED, 0.0, ())
    action, post = runtime_action_fit(runtime)
    # Least squares: the others pull the fit towards their 100 µs, GPipe's 1 s away from it.
    assert 100e-6 < action + post < 1.0 / (2 * SCHEDULE_MICRO_BATCHES)
