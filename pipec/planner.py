"""Plan pass: search micro-batch size and schedule, partition the stages with the exact DP.

For every micro-batch size m dividing the per-replica batch and every schedule, the DP picks the
stage boundaries that minimize the slowest stage under each device's memory; the schedule
simulator then gives the iteration time. The fastest feasible candidate wins.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from pipec.annotate import CostGraph
from pipec.costmodel import (
    Calibration,
    NodeArrays,
    Training,
    allreduce_s,
    boundary_s,
    crosses_nodes,
    node_arrays,
    usable_memory,
)
from pipec.errors import ConfigError, InfeasibleError
from pipec.hardware import GIB, Device
from pipec.partition import Partition, make_problem, solve
from pipec.schedule import SCHEDULES, Simulation, in_flight, runs, simulate


@dataclass(frozen=True)
class PlanRequest:
    gpus: int
    nodes: int
    global_batch: int
    pp: int | None  # None: one stage per device
    micro_batch: int | None  # None: searched
    schedule: str  # "auto" or one of SCHEDULES
    hardware: str
    device: Device
    training: Training
    calibration: Calibration | None = None  # measured compute times (pipec profile)


@dataclass(frozen=True)
class StagePlan:
    index: int
    start: int  # first node (position in CostGraph.nodes)
    end: int  # one past the last node
    modules: tuple[str, ...]
    params: int
    fwd_flops: float  # one micro-batch
    bwd_flops: float
    activation_bytes: float  # one micro-batch
    memory_bytes: float  # static + activations in flight
    time_s: float  # forward + backward + boundary, one micro-batch
    compute_s: float  # forward + backward alone, one micro-batch
    boundary_bytes: float  # sent to the next stage, one micro-batch


@dataclass(frozen=True)
class Candidate:
    """One point of the search: its predicted throughput and whether it fits."""

    micro_batch: int
    num_micro_batches: int
    schedule: str
    samples_per_s: float
    peak_memory_bytes: float
    feasible: bool


@dataclass(frozen=True)
class Baseline:
    name: str
    micro_batch: int
    schedule: str
    samples_per_s: float
    feasible: bool


@dataclass(frozen=True)
class Plan:
    request: PlanRequest
    pp: int
    dp: int
    micro_batch: int
    num_micro_batches: int
    schedule: str
    stages: tuple[StagePlan, ...]
    simulation: Simulation
    iteration_s: float
    samples_per_s: float
    candidates: tuple[Candidate, ...]
    baselines: tuple[Baseline, ...]


@dataclass(frozen=True)
class _Evaluated:
    micro_batch: int
    schedule: str
    partition: Partition
    arrays: NodeArrays
    cut_s: np.ndarray  # (pp, n + 1): stage s sending across each cut
    memory: tuple[float, ...]
    simulation: Simulation
    iteration_s: float


def plan(graph: CostGraph, request: PlanRequest) -> Plan:
    pp, dp = _split_devices(graph, request)
    replica_batch = request.global_batch // dp
    points = [(m, schedule) for m in _micro_batches(request, replica_batch)
              for schedule in _schedules(request) if runs(schedule, pp, replica_batch // m)]
    if not points:
        raise ConfigError(f"--schedule {request.schedule} needs at least {pp} micro-batches per "
                          f"step (one per stage); use a smaller --micro-batch or --schedule gpipe")
    fitting = {point: _evaluate(graph, request, pp, dp, *point, fits_only=True)
               for point in points}
    feasible = [e for e in fitting.values() if e is not None]
    if not feasible:
        raise _infeasible(graph, request, pp, dp)
    best = min(feasible, key=lambda e: (e.iteration_s, max(e.memory), -e.micro_batch,
                                        SCHEDULES.index(e.schedule)))
    # Points that do not fit are reported with their time-balanced plan's memory, to show why.
    candidates = tuple(_candidate(request, dp, e or _unlimited(graph, request, pp, dp, *point))
                       for point, e in fitting.items())
    return Plan(request, pp, dp, best.micro_batch, replica_batch // best.micro_batch,
                best.schedule, _stage_plans(graph, best), best.simulation, best.iteration_s,
                request.global_batch / best.iteration_s, candidates,
                (_conventional(graph, request, pp, dp),))


def _split_devices(graph: CostGraph, request: PlanRequest) -> tuple[int, int]:
    pp = request.pp or request.gpus
    if request.gpus % pp:
        raise ConfigError(f"--pp {pp} does not divide --gpus {request.gpus}; "
                          "pipeline stages × data-parallel replicas must equal the device count")
    dp = request.gpus // pp
    if request.global_batch % dp:
        raise ConfigError(f"--batch-size {request.global_batch} is not divisible by the "
                          f"{dp} data-parallel replicas; use a multiple of {dp}")
    cuts = sum(graph.legal_cuts[1:-1])
    if pp > cuts + 1:
        raise ConfigError(f"the model has {len(graph.nodes)} nodes and only {cuts} legal stage "
                          f"boundaries, so at most {cuts + 1} stages; use --pp {cuts + 1} or less")
    return pp, dp


def _micro_batches(request: PlanRequest, replica_batch: int) -> list[int]:
    if request.micro_batch is None:
        return [m for m in range(1, replica_batch + 1) if replica_batch % m == 0]
    if request.micro_batch < 1 or replica_batch % request.micro_batch:
        raise ConfigError(f"--micro-batch {request.micro_batch} does not divide the per-replica "
                          f"batch {replica_batch}; pick a divisor of {replica_batch}")
    return [request.micro_batch]


def _schedules(request: PlanRequest) -> tuple[str, ...]:
    if request.schedule == "auto":
        return SCHEDULES
    if request.schedule not in SCHEDULES:
        raise ConfigError(f"schedule {request.schedule!r} is not supported yet; "
                          f"use one of auto, {', '.join(SCHEDULES)}")
    return (request.schedule,)


def _evaluate(graph: CostGraph, request: PlanRequest, pp: int, dp: int, micro_batch: int,
              schedule: str, fits_only: bool) -> _Evaluated | None:
    """Partition and simulate one candidate; with ``fits_only`` False, memory is ignored."""
    arrays = node_arrays(graph, request.device, micro_batch, request.training,
                         request.calibration)
    num_micro_batches = request.global_batch // (dp * micro_batch)
    flights = in_flight(schedule, pp, num_micro_batches)
    capacity = usable_memory(request.device) if fits_only else float("inf")
    cut_s = _boundary_times(request, arrays, pp, dp)
    problem = make_problem(arrays.fwd_s + arrays.bwd_s, arrays.static_bytes,
                           arrays.activation_bytes, cut_s,
                           np.array(graph.legal_cuts), (capacity,) * pp, flights)
    partition = solve(problem)
    if partition is None:
        return None
    spans = list(itertools.pairwise(partition.boundaries))
    memory = tuple(float(arrays.static_bytes[a:b].sum() + f * arrays.activation_bytes[a:b].sum())
                   for (a, b), f in zip(spans, flights, strict=True))
    fwd = [float(arrays.fwd_s[a:b].sum() + cut_s[s, b] / 2) for s, (a, b) in enumerate(spans)]
    bwd = [float(arrays.bwd_s[a:b].sum() + cut_s[s, b] / 2) for s, (a, b) in enumerate(spans)]
    simulation = simulate(schedule, fwd, bwd, num_micro_batches)
    grad_bytes = max(sum(n.param_bytes for n in graph.nodes[a:b]) for a, b in spans)
    iteration = simulation.iteration_s + allreduce_s(grad_bytes, dp, request.device)
    return _Evaluated(micro_batch, schedule, partition, arrays, cut_s, memory, simulation,
                      iteration)


def _boundary_times(request: PlanRequest, arrays: NodeArrays, pp: int, dp: int) -> np.ndarray:
    """Per stage, the time to send across each cut over the link to the next stage's device."""
    per_node = request.gpus // request.nodes
    return np.stack([boundary_s(arrays.cut_bytes, request.device,
                                crosses_nodes(s, pp, dp, per_node)) for s in range(pp)])


def _unlimited(graph: CostGraph, request: PlanRequest, pp: int, dp: int, micro_batch: int,
               schedule: str) -> _Evaluated:
    """The candidate partitioned for time alone (no memory limit): always exists."""
    e = _evaluate(graph, request, pp, dp, micro_batch, schedule, fits_only=False)
    assert e is not None  # without a memory limit every legal partition is allowed
    return e


def _candidate(request: PlanRequest, dp: int, e: _Evaluated) -> Candidate:
    return Candidate(e.micro_batch, request.global_batch // (dp * e.micro_batch), e.schedule,
                     request.global_batch / e.iteration_s, max(e.memory),
                     max(e.memory) <= usable_memory(request.device))


def _conventional(graph: CostGraph, request: PlanRequest, pp: int, dp: int) -> Baseline:
    """The study's baseline: torchgpipe's time balance, GPipe, M = 4 · pp micro-batches."""
    replica_batch = request.global_batch // dp
    micro_batch = max(1, replica_batch // (4 * pp))
    while replica_batch % micro_batch:
        micro_batch -= 1
    e = _unlimited(graph, request, pp, dp, micro_batch, "gpipe")
    return Baseline("conventional", micro_batch, "gpipe", request.global_batch / e.iteration_s,
                    max(e.memory) <= usable_memory(request.device))


def _stage_plans(graph: CostGraph, e: _Evaluated) -> tuple[StagePlan, ...]:
    bounds = e.partition.boundaries
    return tuple(_stage_plan(graph, e, s, a, b)
                 for s, (a, b) in enumerate(itertools.pairwise(bounds)))


def _stage_plan(graph: CostGraph, e: _Evaluated, s: int, a: int, b: int) -> StagePlan:
    nodes = graph.nodes[a:b]
    m = e.micro_batch
    return StagePlan(
        index=s, start=a, end=b, modules=_module_names([n.module for n in nodes]),
        params=sum(n.params for n in nodes),
        fwd_flops=sum(n.fwd_flops.at(m) for n in nodes),
        bwd_flops=sum(n.bwd_flops.at(m) for n in nodes),
        activation_bytes=float(e.arrays.activation_bytes[a:b].sum()),
        memory_bytes=e.memory[s],
        time_s=float(e.arrays.fwd_s[a:b].sum() + e.arrays.bwd_s[a:b].sum() + e.cut_s[s, b]),
        compute_s=float(e.arrays.fwd_s[a:b].sum() + e.arrays.bwd_s[a:b].sum()),
        boundary_bytes=0.0 if b == len(graph.nodes) else graph.cut_bytes[b].at(m),
    )


def _module_names(owners: list[str], depth: int = 2) -> tuple[str, ...]:
    """Distinct module names (first ``depth`` levels) in order of first appearance."""
    names: dict[str, None] = {}
    for owner in owners:
        if owner:
            names[".".join(owner.split(".")[:depth])] = None
    return tuple(names)


def _infeasible(graph: CostGraph, request: PlanRequest, pp: int, dp: int) -> InfeasibleError:
    e = _unlimited(graph, request, pp, dp, 1,
                   "gpipe" if request.global_batch // dp < pp else "1f1b")
    need = max(e.memory) / GIB
    have = usable_memory(request.device) / GIB
    return InfeasibleError(
        f"the model needs {need:.2f} GiB on its fullest device even at micro-batch 1, have "
        f"{have:.2f} GiB usable on {request.hardware}; try more --gpus, a device with more "
        "memory (--hardware) or --optimizer sgd")
