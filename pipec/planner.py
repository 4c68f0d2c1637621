"""Plan pass: search micro-batch size and schedule, partition the stages with the exact DP.

For every micro-batch size m dividing the per-replica batch and every schedule, the DP picks the
stage boundaries that minimize the slowest stage under each device's memory; the schedule
simulator then gives the iteration time. The fastest feasible candidate wins.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

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
    strategy: str = "pipec"  # or a baseline's name: plan as that baseline would


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
    pp: int
    dp: int


@dataclass(frozen=True)
class Baseline:
    name: str
    micro_batch: int
    schedule: str
    samples_per_s: float
    feasible: bool


@dataclass(frozen=True)
class MaxBatch:
    """The largest global batch a method trains within memory on the given devices."""

    method: str
    batch: int  # 0: not even the smallest batch fits
    capped: bool  # still fits at the search limit: memory does not bound it


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
    max_batch: tuple[MaxBatch, ...]  # pipec first, then each baseline
    max_batch_limit: int  # the search stops here


@dataclass(frozen=True)
class _Evaluated:
    pp: int
    dp: int
    micro_batch: int
    schedule: str
    partition: Partition
    arrays: NodeArrays
    cut_s: np.ndarray  # (pp, n + 1): stage s sending across each cut
    memory: tuple[float, ...]
    simulation: Simulation
    iteration_s: float


BALANCES = {"uniform": "uniform", "parameters": "parameters", "torchgpipe": "time"}
STRATEGIES = ("pipec", *BALANCES, "conventional")


def plan(graph: CostGraph, request: PlanRequest) -> Plan:
    """The fastest plan that fits, over pp × dp, micro-batch, schedule and stage boundaries."""
    if request.strategy not in STRATEGIES:
        raise ConfigError(f"--strategy {request.strategy!r}: use one of {', '.join(STRATEGIES)}")
    searches = [_search(graph, request, pp, dp) for pp, dp in _device_splits(graph, request)]
    feasible = [s for s in searches if s.best is not None]
    if not feasible:
        raise _infeasible(graph, request, *_device_splits(graph, request)[-1])
    chosen = min(feasible, key=lambda s: _rank(s.best))  # type: ignore[arg-type]
    baselines = tuple(_baseline(graph, request, chosen.pp, chosen.dp, name)
                      for name in STRATEGIES[1:-1])
    baselines += (_baseline(graph, request, *_pure_pipeline(graph, request), "conventional"),)
    best = _adopt(chosen.best, baselines, request)  # type: ignore[arg-type]
    candidates = tuple(c for s in searches for c in s.candidates)
    pp, dp = best.pp, best.dp
    limit = MAX_BATCH_FACTOR * request.global_batch
    capacity = _max_batches(graph, request, (chosen.pp, chosen.dp), limit)
    return Plan(request, pp, dp, best.micro_batch,
                request.global_batch // (dp * best.micro_batch), best.schedule,
                _stage_plans(graph, best), best.simulation, best.iteration_s,
                request.global_batch / best.iteration_s, candidates,
                tuple(b.summary for b in baselines), capacity, limit)


@dataclass(frozen=True)
class _Search:
    pp: int
    dp: int
    best: _Evaluated | None
    candidates: tuple[Candidate, ...]


@dataclass(frozen=True)
class _BaselineResult:
    summary: Baseline
    evaluated: _Evaluated


def _pure_pipeline(graph: CostGraph, request: PlanRequest) -> tuple[int, int]:
    """The study's conventional setup: one pipeline over every device (or --pp's)."""
    cuts = sum(graph.legal_cuts[1:-1])
    pp = request.pp or max(p for p in range(1, min(request.gpus, cuts + 1) + 1)
                           if request.gpus % p == 0
                           and request.global_batch % (request.gpus // p) == 0)
    return pp, request.gpus // pp


def _rank(e: _Evaluated) -> tuple[float, float, int, int]:
    """Faster first; then less memory, a larger micro-batch, the earlier schedule."""
    return (e.iteration_s, max(e.memory), -e.micro_batch, SCHEDULES.index(e.schedule))


def _search(graph: CostGraph, request: PlanRequest, pp: int, dp: int) -> _Search:
    replica_batch = request.global_batch // dp
    points = [(m, schedule) for m in _micro_batches(request, replica_batch)
              for schedule in _schedules(request) if runs(schedule, pp, replica_batch // m)]
    if not points:
        raise ConfigError(f"--schedule {request.schedule} needs at least {pp} micro-batches per "
                          f"step (one per stage); use a smaller --micro-batch or --schedule gpipe")
    fitting = {point: _evaluate(graph, request, pp, dp, *point, balance="pipec")
               for point in points}
    feasible = [e for e in fitting.values() if e is not None]
    # Points that do not fit are reported with their time-balanced plan's memory, to show why.
    candidates = tuple(_candidate(request, pp, dp, e or _unlimited(graph, request, pp, dp, *point))
                       for point, e in fitting.items())
    return _Search(pp, dp, min(feasible, key=_rank) if feasible else None, candidates)


def _device_splits(graph: CostGraph, request: PlanRequest) -> list[tuple[int, int]]:
    """(pp, dp) pairs to search: the one --pp gives, or every pp dividing the device count."""
    if request.pp is not None:
        return [_split_devices(graph, request, request.pp)]
    cuts = sum(graph.legal_cuts[1:-1])
    splits = [(pp, request.gpus // pp) for pp in range(1, request.gpus + 1)
              if request.gpus % pp == 0 and pp <= cuts + 1
              and request.global_batch % (request.gpus // pp) == 0]
    if not splits:
        raise ConfigError(f"--batch-size {request.global_batch} is not divisible by any "
                          f"data-parallel degree of {request.gpus} devices that this model's "
                          f"{cuts + 1} possible stages allow; use a multiple of {request.gpus}")
    return splits


def _split_devices(graph: CostGraph, request: PlanRequest, pp: int) -> tuple[int, int]:
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
              schedule: str, balance: str) -> _Evaluated | None:
    """Partition and simulate one candidate.

    ``balance`` picks the boundaries: "pipec", the exact DP on time under each device's memory
    (None when nothing fits); "time", the same DP ignoring memory (torchgpipe's balance);
    "parameters", the DP on parameter counts (DeepSpeed's); "uniform", equal node counts.
    """
    arrays = node_arrays(graph, request.device, micro_batch, request.training,
                         request.calibration)
    num_micro_batches = request.global_batch // (dp * micro_batch)
    flights = in_flight(schedule, pp, num_micro_batches)
    cut_s = _boundary_times(request, arrays, pp, dp)
    boundaries = _boundaries(graph, request, arrays, cut_s, flights, balance)
    if boundaries is None:
        return None
    spans = list(itertools.pairwise(boundaries))
    partition = Partition(boundaries, max(float(arrays.fwd_s[a:b].sum() + arrays.bwd_s[a:b].sum()
                                                + cut_s[s, b]) for s, (a, b) in enumerate(spans)))
    memory = tuple(float(arrays.static_bytes[a:b].sum() + f * arrays.activation_bytes[a:b].sum())
                   for (a, b), f in zip(spans, flights, strict=True))
    fwd = [float(arrays.fwd_s[a:b].sum() + cut_s[s, b] / 2) for s, (a, b) in enumerate(spans)]
    bwd = [float(arrays.bwd_s[a:b].sum() + cut_s[s, b] / 2) for s, (a, b) in enumerate(spans)]
    simulation = simulate(schedule, fwd, bwd, num_micro_batches)
    grad_bytes = max(sum(n.param_bytes for n in graph.nodes[a:b]) for a, b in spans)
    iteration = simulation.iteration_s + allreduce_s(grad_bytes, dp, request.device)
    return _Evaluated(pp, dp, micro_batch, schedule, partition, arrays, cut_s, memory, simulation,
                      iteration)


def _boundaries(graph: CostGraph, request: PlanRequest, arrays: NodeArrays, cut_s: np.ndarray,
                flights: tuple[int, ...], balance: str) -> tuple[int, ...] | None:
    legal = np.array(graph.legal_cuts)
    if balance == "uniform":
        return uniform_boundaries(legal, len(flights))
    cost = (np.array([n.params for n in graph.nodes], dtype=float) if balance == "parameters"
            else arrays.fwd_s + arrays.bwd_s)
    capacity = usable_memory(request.device) if balance == "pipec" else float("inf")
    problem = make_problem(cost, arrays.static_bytes, arrays.activation_bytes,
                           cut_s if balance != "parameters" else np.zeros_like(cut_s), legal,
                           (capacity,) * len(flights), flights)
    partition = solve(problem)
    return None if partition is None else partition.boundaries


def uniform_boundaries(legal: np.ndarray, stages: int) -> tuple[int, ...]:
    """Equal node counts per stage, each boundary moved to the nearest free legal cut."""
    n = len(legal) - 1
    cuts = [i for i in range(1, n) if legal[i]]
    chosen: list[int] = []
    for s in range(1, stages):
        free = [c for c in cuts if c not in chosen and (not chosen or c > chosen[-1])]
        # Leave enough legal cuts for the stages still to come.
        free = free[:len(free) - (stages - 1 - s)]
        chosen.append(min(free, key=lambda c: abs(c - s * n / stages)))
    return (0, *chosen, n)


def _boundary_times(request: PlanRequest, arrays: NodeArrays, pp: int, dp: int) -> np.ndarray:
    """Per stage, the time to send across each cut over the link to the next stage's device."""
    per_node = request.gpus // request.nodes
    return np.stack([boundary_s(arrays.cut_bytes, request.device,
                                crosses_nodes(s, pp, dp, per_node)) for s in range(pp)])


def _unlimited(graph: CostGraph, request: PlanRequest, pp: int, dp: int, micro_batch: int,
               schedule: str, balance: str = "time") -> _Evaluated:
    """A candidate partitioned without a memory limit: always exists."""
    e = _evaluate(graph, request, pp, dp, micro_batch, schedule, balance)
    assert e is not None  # without a memory limit every legal partition is allowed
    return e


def _fits(request: PlanRequest, e: _Evaluated) -> bool:
    return max(e.memory) <= usable_memory(request.device)


def _candidate(request: PlanRequest, pp: int, dp: int, e: _Evaluated) -> Candidate:
    return Candidate(e.micro_batch, request.global_batch // (dp * e.micro_batch), e.schedule,
                     request.global_batch / e.iteration_s, max(e.memory), _fits(request, e),
                     pp, dp)


def _baseline(graph: CostGraph, request: PlanRequest, pp: int, dp: int,
              name: str) -> _BaselineResult:
    """A baseline on the given pp × dp: its boundary rule, and the best micro-batch and
    schedule for them (the fastest that fits, else the fastest); `conventional` is the study's:
    torchgpipe's time balance, GPipe, M = 4 · pp micro-batches, on one pipeline."""
    replica_batch = request.global_batch // dp
    if name == "conventional":
        micro_batch = max(1, replica_batch // (4 * pp))
        while replica_batch % micro_batch:
            micro_batch -= 1
        tried = [_unlimited(graph, request, pp, dp, micro_batch, "gpipe")]
    else:
        tried = [_unlimited(graph, request, pp, dp, m, schedule, BALANCES[name])
                 for m in _micro_batches(request, replica_batch) for schedule in SCHEDULES
                 if runs(schedule, pp, replica_batch // m)]
    fitting = [e for e in tried if _fits(request, e)]
    e = min(fitting or tried, key=_rank)
    return _BaselineResult(Baseline(name, e.micro_batch, e.schedule,
                                    request.global_batch / e.iteration_s, bool(fitting)), e)


def _adopt(best: _Evaluated, baselines: tuple[_BaselineResult, ...], request: PlanRequest
           ) -> _Evaluated:
    """The plan to emit: a baseline's when asked (--strategy), else pipec's. pipec's search
    includes the baselines' partitions: a feasible baseline that simulates faster, within what
    the user fixed (--micro-batch, --schedule, --pp), wins."""
    strategy = request.strategy
    if strategy != "pipec":
        result = next(b for b in baselines if b.summary.name == strategy)
        if not result.summary.feasible:
            raise InfeasibleError(f"--strategy {strategy} does not fit: it needs "
                                  f"{max(result.evaluated.memory) / GIB:.2f} GiB on its fullest "
                                  "device; use --strategy pipec or more devices")
        return result.evaluated
    faster = [b.evaluated for b in baselines
              if b.summary.feasible and b.evaluated.iteration_s < best.iteration_s
              and _allowed(b.evaluated, request)]
    return min([best, *faster], key=_rank)


def _allowed(e: _Evaluated, request: PlanRequest) -> bool:
    return (request.micro_batch in (None, e.micro_batch) and request.pp in (None, e.pp)
            and request.schedule in ("auto", e.schedule))


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


# The maximum-batch search stops at this multiple of --batch-size.
MAX_BATCH_FACTOR = 64


def _max_batches(graph: CostGraph, request: PlanRequest, chosen: tuple[int, int],
                 limit: int) -> tuple[MaxBatch, ...]:
    """pipec (any pp × dp it may pick) and each baseline (its own boundaries and pp × dp)."""
    methods: list[tuple[str, list[tuple[int, int]], str]] = [
        ("pipec", _device_splits(graph, request), "pipec")]
    methods += [(name, [chosen], balance) for name, balance in BALANCES.items()]
    methods.append(("conventional", [_pure_pipeline(graph, request)], "time"))
    return tuple(_max_batch(graph, request, name, options, balance, limit)
                 for name, options, balance in methods)


def _max_batch(graph: CostGraph, request: PlanRequest, method: str,
               splits: list[tuple[int, int]], balance: str, limit: int) -> MaxBatch:
    def fits(batch: int) -> bool:
        return any(_fits_batch(graph, request, method, pp, dp, balance, batch)
                   for pp, dp in splits if batch % (dp * (4 * pp if method == "conventional"
                                                          else 1)) == 0)
    # Batches tried: multiples of the device count (every split's dp divides it); conventional
    # needs 4 · pp micro-batches on each of its dp replicas.
    unit = (splits[0][1] * 4 * splits[0][0] if method == "conventional" else request.gpus)
    if not fits(unit):
        return MaxBatch(method, 0, False)
    if method != "conventional" and _bounded_by_flight(request):
        # Under 1F1B at micro-batch 1 a stage holds at most pp micro-batches whatever the batch:
        # fitting once means fitting at any size.
        return MaxBatch(method, limit, True)
    low, high = 1, 2  # in units
    while high * unit <= limit and fits(high * unit):
        low, high = high, high * 2
    if high * unit > limit:
        return MaxBatch(method, low * unit, low * unit * 2 > limit)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle * unit) else (low, middle)
    return MaxBatch(method, low * unit, False)


def _bounded_by_flight(request: PlanRequest) -> bool:
    return request.schedule in ("auto", "1f1b")


def _fits_batch(graph: CostGraph, request: PlanRequest, method: str, pp: int, dp: int,
                balance: str, batch: int) -> bool:
    """Whether ``method`` trains a global ``batch`` in memory in its leanest configuration:
    micro-batch 1 under 1F1B (or GPipe where 1F1B is not allowed); conventional: its own."""
    sized = replace(request, global_batch=batch)
    if method == "conventional":
        micro_batch, schedule = batch // (dp * 4 * pp), "gpipe"
    else:
        micro_batch = 1
        schedule = "1f1b" if _bounded_by_flight(request) and runs("1f1b", pp, batch // dp) \
            else "gpipe"
    e = _evaluate(graph, sized, pp, dp, micro_batch, schedule, balance)
    return e is not None and _fits(sized, e)


def _infeasible(graph: CostGraph, request: PlanRequest, pp: int, dp: int) -> InfeasibleError:
    e = _unlimited(graph, request, pp, dp, 1,
                   "gpipe" if request.global_batch // dp < pp else "1f1b", balance="time")
    need = max(e.memory) / GIB
    have = usable_memory(request.device) / GIB
    return InfeasibleError(
        f"the model needs {need:.2f} GiB on its fullest device even at micro-batch 1, have "
        f"{have:.2f} GiB usable on {request.hardware}; try more --gpus, a device with more "
        "memory (--hardware) or --optimizer sgd")
