"""The runtime probe's measurements (pipec.calibration.probe) fitted to the cost model's terms:
the data-parallel step's wait, bandwidth and time per gradient tensor, a blocking all-reduce's
drift, and the runtime's time per action and per posted send or receive. Each fit makes the
model reproduce what the probe measured, through the same formulas and simulator the planner
uses (pipec.cost.model, pipec.planning.simulate)."""

from __future__ import annotations

import functools
import math

import numpy as np

from pipec.calibration.action_times import SCHEDULE_MICRO_BATCHES
from pipec.calibration.allreduce_times import (
    DATA_PARALLEL_SHAPES,
    data_parallel_bytes,
    data_parallel_tensors,
)
from pipec.calibration.probe import RuntimeFigures
from pipec.cost.model import data_parallel_collectives
from pipec.planning.schedules import ZERO_BUBBLE, posted_links, stage_device
from pipec.planning.simulate import simulate


def data_parallel_fit(runtime: RuntimeFigures, replicas: int | None = None
                      ) -> tuple[float, float, float]:
    """Each all-reduce's wait in a step, the bus bandwidth and the time per gradient tensor
    that make the model reproduce the probe's three data-parallel steps (DATA_PARALLEL_SHAPES)
    on every process, or on ``replicas`` of them while the others wait
    (``group_data_parallel_s``): the all-reduces of data_parallel_collectives, the ring's
    latency and bytes, DDP's work per gradient tensor, the runtime's step overhead, and the lead
    one process takes on the other over the step's compute (blocking_fit's drift · √T). The
    third model, with as few bytes as the first but 12 times its tensors, gives the time per
    tensor; the first, whose bytes cost next to nothing, the wait; the second, the bandwidth
    (the all-reduce's own where its bytes explain less than the noise)."""
    d = replicas or runtime.processes
    steps = (runtime.data_parallel_s if replicas is None
             else dict((int(n), s) for n, s in runtime.group_data_parallel_s)[replicas])
    share = 2 * (d - 1) / d  # of the bytes, over the bus
    fixed = runtime.step_overhead_s + 2 * (d - 1) * runtime.latency_s  # the ring's
    drift = blocking_fit(runtime)[1]
    small_s, large_s, many_s = (extra - drift * math.sqrt(compute) for compute, extra in steps)
    small, large, many = (data_parallel_bytes(*shape) for shape in DATA_PARALLEL_SHAPES)
    small_t, large_t, many_t = (data_parallel_tensors(n) for _, n in DATA_PARALLEL_SHAPES)
    bandwidth, per_tensor, collective = runtime.allreduce_bandwidth, 0.0, 0.0
    for _ in range(3):  # the small models' few bytes, at the bandwidth fitted so far
        per_tensor = max(many_s - small_s - share * (many - small) / bandwidth, 0.0) \
            / (many_t - small_t)
        collective = max(small_s - fixed - share * small / bandwidth - small_t * per_tensor,
                         0.0) / data_parallel_collectives(small)
        bytes_s = large_s - fixed - data_parallel_collectives(large) * collective \
            - large_t * per_tensor
        bandwidth = share * large / bytes_s if bytes_s > 0 else runtime.allreduce_bandwidth
    return collective, bandwidth, per_tensor


def blocking_fit(runtime: RuntimeFigures) -> tuple[float, float]:
    """A blocking all-reduce's cost in a pass as a + drift · √T, T the compute since the one
    before, through the blocking probe's two sizes: between two waits each replica's compute
    wanders by independent amounts (its kernels' times, what else the cores run), which add up
    as a random walk's, ∝ √T; the replica that waits waits for the other's lead. (0, 0) where
    not measured."""
    if len(runtime.blocking_s) < 2:
        return 0.0, 0.0
    (short_s, short_extra), (long_s, long_extra) = runtime.blocking_s[:2]
    rise = math.sqrt(long_s) - math.sqrt(short_s)
    drift = max((long_extra - short_extra) / rise, 0.0) if rise > 0 else 0.0
    return max(short_extra - drift * math.sqrt(short_s), 0.0), drift


def runtime_action_fit(runtime: RuntimeFigures) -> tuple[float, float]:
    """(seconds per action, seconds per send or receive posted to another device) with which
    the simulator best reproduces the probe's measured steps of every schedule
    (pipec.calibration.probe's 2-device pipelines of a layer without compute); (0, 0) where not
    measured.

    Least squares in the relative error, both ≥ 0, by Gauss-Newton: a step is piecewise
    linear in both. Two terms, not a time per action for each schedule: ZB-V posts a send or
    receive in 2 of its 3 actions per stage and micro-batch, interleaved 1F1B in every one,
    and a per-schedule time per action learnt that from the probe's pipeline, where
    every action waits for the other device, then charged it to every action of a real plan.
    A real plan pays the posts × the contention of every process (pipec.planning.points.Costs);
    benchmarks/studies/repredict.py measures the fit against saved plans (docs/fidelity.md)."""
    if not runtime.schedule_step_s:
        return 0.0, 0.0
    link = runtime.latency_s + 16 / runtime.bandwidth  # a micro-batch of 4 fp32 values
    return _action_fit(tuple(sorted(runtime.schedule_step_s.items())), link)


@functools.cache  # each device of a compile asks (tens of ms each)
def _action_fit(measured: tuple[tuple[str, float], ...], link: float) -> tuple[float, float]:
    steps = dict(measured)
    names = sorted(steps)
    fit = np.array([min(steps.values()) / (4 * SCHEDULE_MICRO_BATCHES), 0.0])
    for _ in range(_FIT_ROUNDS):
        errors = np.array([_relative_error(s, fit, steps[s], link) for s in names])
        slopes = np.array([[(_relative_error(s, fit + step, steps[s], link) - error)
                            / _SLOPE_STEP_S for step in _SLOPE_STEPS]
                           for s, error in zip(names, errors, strict=True)])
        fit = _nonnegative_lstsq(slopes, slopes @ fit - errors)
    return float(fit[0]), float(fit[1])


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ‖a·x − b‖ over x ≥ 0, for ``a`` of two columns: the unconstrained answer where
    it is non-negative, else the better of the answers with one of the two at 0."""
    candidates = [np.linalg.lstsq(a, b, rcond=None)[0]]
    for column in range(2):
        alone = np.zeros(2)
        norm = float(a[:, column] @ a[:, column])
        alone[column] = max(float(a[:, column] @ b) / norm, 0.0) if norm > 0 else 0.0
        candidates.append(alone)
    feasible = [x for x in candidates if (x >= 0).all()]
    return min(feasible, key=lambda x: float(np.linalg.norm(a @ x - b)))


_FIT_ROUNDS = 12  # Gauss-Newton's; it settles in 3-5 (a 2-core AMD EPYC VM's probes)
_SLOPE_STEP_S = 1e-6
_SLOPE_STEPS = (np.array([_SLOPE_STEP_S, 0.0]), np.array([0.0, _SLOPE_STEP_S]))


def _relative_error(schedule: str, fit: np.ndarray, step_s: float, link_s: float) -> float:
    return probe_step_s(schedule, float(fit[0]), float(fit[1]), link_s) / step_s - 1


def probe_step_s(schedule: str, action_s: float, post_s: float, link_s: float) -> float:
    """The simulated step of the probe's pipeline under ``schedule``
    (pipec.calibration.action_times): each action pays ``action_s``, and ``post_s`` per send or
    receive to the other device, each boundary that crosses a link ``link_s``, as Costs charges
    them; a zero-bubble backward pays its call's time twice, its weights' gradient once, and the
    links carry the transfers (pipec.planning.evaluate)."""
    stages = 2 if schedule in ("gpipe", "1f1b") else 4
    cuts = probe_cuts(schedule, stages, link_s)
    links = (cuts, [0.0, *cuts[:-1]])  # forward to the next stage, backward to the one before
    posts = posted_links([stage_device(schedule, k, 2) for k in range(stages)])
    forward = [action_s + post_s * n for n in posts]
    if schedule not in ZERO_BUBBLE:
        return simulate(schedule, forward, forward, SCHEDULE_MICRO_BATCHES, 2,
                        timeline=False, transfer_s=links).iteration_s
    return simulate(schedule, forward, [f + action_s for f in forward],
                    SCHEDULE_MICRO_BATCHES, 2, timeline=False,
                    weight_s=[action_s] * stages, transfer_s=links).iteration_s


def probe_cuts(schedule: str, stages: int, link_s: float) -> list[float]:
    """Per stage of the probe's pipeline, the link its output crosses: none after the last,
    nor where the next stage sits on the same device (ZB-V's turn), as Costs charges them."""
    return [link_s if k < stages - 1 and stage_device(schedule, k, 2)
            != stage_device(schedule, k + 1, 2) else 0.0 for k in range(stages)]
