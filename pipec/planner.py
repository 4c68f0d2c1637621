"""Plan pass: search pp × dp, micro-batch size and schedule; partition stages with the exact DP.

For every split of the devices into pp pipeline positions × dp replicas, every micro-batch size m
dividing the per-replica batch and every schedule (interleaved: v stages per device), the DP
picks the stage boundaries that minimize the slowest stage under each device's memory; the
schedule simulator then gives the iteration time. The fastest feasible candidate wins.

The search is branch and bound: candidates are evaluated from the smallest lower bound on their
iteration time up, and stop once the bound exceeds the best plan found (the bound is the busiest
device's share of the work at the fastest device's speed, plus the all-reduce of an equal share
of the gradients; every candidate's simulated time is at least that).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import numpy as np

from pipec.annotate import CostGraph
from pipec.costmodel import (
    Calibration,
    NodeArrays,
    StageMemory,
    StageRole,
    Training,
    allreduce_s,
    boundary_s,
    crosses_nodes,
    ends_bytes,
    node_arrays,
    spans_nodes,
    stage_memory,
    usable_memory,
)
from pipec.errors import ConfigError, InfeasibleError
from pipec.hardware import GIB, Device
from pipec.partition import make_problem, solve
from pipec.schedule import (
    SCHEDULES,
    Simulation,
    in_flight,
    lower_bound_s,
    runs,
    simulate,
    stage_lower_bound_s,
)

# Interleaved 1F1B: the stages per device searched when --virtual-stages is not given.
VIRTUAL_STAGES = (2, 3, 4)


@dataclass(frozen=True)
class PlanRequest:
    gpus: int
    nodes: int
    global_batch: int
    pp: int | None  # None: searched
    micro_batch: int | None  # None: searched
    schedule: str  # "auto" or one of SCHEDULES
    hardware: str
    devices: tuple[Device, ...]  # one per rank, in rank order
    training: Training
    calibration: Calibration | None = None  # measured compute times (pipec profile)
    strategy: str = "pipec"  # or a baseline's name: plan as that baseline would
    virtual_stages: int | None = None  # interleaved: stages per device; None: searched


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
    memory_bytes: float  # its peak: every term of ``memory`` (this stage alone)
    time_s: float  # forward + backward + boundary, one micro-batch
    compute_s: float  # forward + backward alone, one micro-batch
    boundary_bytes: float  # sent to the next stage, one micro-batch
    device: int = 0  # pipeline position (rank mod pp) that runs it
    fwd_s: float = 0.0  # forward compute alone, one micro-batch
    bwd_s: float = 0.0  # backward compute alone, one micro-batch
    memory: StageMemory | None = None  # memory_bytes by term


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
    virtual_stages: int = 1


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
    pp: int  # pipeline devices
    dp: int
    micro_batch: int
    num_micro_batches: int
    schedule: str
    stages: tuple[StagePlan, ...]  # pp · virtual_stages of them
    simulation: Simulation
    iteration_s: float
    samples_per_s: float
    candidates: tuple[Candidate, ...]  # every candidate evaluated
    baselines: tuple[Baseline, ...]
    max_batch: tuple[MaxBatch, ...]  # pipec first, then each baseline
    max_batch_limit: int  # the search stops here
    virtual_stages: int = 1
    pruned: int = 0  # candidates skipped: their lower bound was slower than the plan
    device_memory_bytes: tuple[float, ...] = ()  # per pipeline position, at its peak


@dataclass(frozen=True)
class _Layout:
    """pp pipeline positions × dp replicas, v stages per position (interleaved)."""

    pp: int
    dp: int
    virtual: int = 1

    @property
    def stages(self) -> int:
        return self.pp * self.virtual


@dataclass(frozen=True)
class _Point:
    layout: _Layout
    micro_batch: int
    schedule: str


@dataclass(frozen=True)
class _StageCosts:
    """Per-node costs as each stage sees them on the devices it lands on (rows: stages)."""

    time_s: np.ndarray  # (stages, n): forward + backward
    fwd_s: np.ndarray  # (stages, n)
    bwd_s: np.ndarray  # (stages, n)
    arrays: NodeArrays  # device-independent bytes
    cut_s: np.ndarray  # (stages, n + 1): sending across each cut to the next stage
    capacity: tuple[float, ...]  # per position: usable bytes of its smallest device
    runtime: tuple[float, ...]  # per position: the runtime's own bytes beside the stages
    # What every stage pays per micro-batch besides its nodes (calling it, starting autograd's
    # engine), forward and backward: the same for all stages, so the partition ignores it.
    overhead_s: tuple[float, float] = (0.0, 0.0)


@dataclass(frozen=True)
class _Evaluated:
    point: _Point
    boundaries: tuple[int, ...]
    costs: _StageCosts
    memory: tuple[float, ...]  # per position, the runtime's own bytes included
    stage_memory: tuple[StageMemory, ...]  # per stage
    simulation: Simulation | None  # None: only the memory was needed
    iteration_s: float

    @property
    def layout(self) -> _Layout:
        return self.point.layout

    @property
    def micro_batch(self) -> int:
        return self.point.micro_batch

    @property
    def schedule(self) -> str:
        return self.point.schedule

    def fits(self) -> bool:
        return all(m <= c for m, c in zip(self.memory, self.costs.capacity, strict=True))


BALANCES = {"uniform": "uniform", "parameters": "parameters", "torchgpipe": "time"}
STRATEGIES = ("pipec", *BALANCES, "conventional")


def plan(graph: CostGraph, request: PlanRequest) -> Plan:
    """The fastest plan that fits, over pp × dp, micro-batch, schedule and stage boundaries."""
    _check(request)
    costs = _Costs(graph, request)
    splits = _device_splits(costs)
    best, candidates, pruned = _search(costs, _points(costs, splits))
    if best is None:
        raise _infeasible(costs, *splits[-1])
    searched = _Layout(best.layout.pp, best.layout.dp)
    baselines = tuple(_baseline(costs, searched, name) for name in STRATEGIES[1:-1])
    baselines += (_baseline(costs, _Layout(*_pure_pipeline(costs)), "conventional"),)
    chosen = _timed(costs, replace(_adopt(best, baselines, request), simulation=None),
                    timeline=True)
    assert chosen.simulation is not None
    limit = MAX_BATCH_FACTOR * request.global_batch
    layout = chosen.layout
    return Plan(request, layout.pp, layout.dp, chosen.micro_batch,
                request.global_batch // (layout.dp * chosen.micro_batch), chosen.schedule,
                _stage_plans(costs, chosen), chosen.simulation, chosen.iteration_s,
                request.global_batch / chosen.iteration_s, candidates,
                tuple(b.summary for b in baselines),
                _max_batches(costs, (searched.pp, searched.dp), limit), limit,
                layout.virtual, pruned, chosen.memory)


def _check(request: PlanRequest) -> None:
    if request.strategy not in STRATEGIES:
        raise ConfigError(f"--strategy {request.strategy!r}: use one of {', '.join(STRATEGIES)}")
    if request.schedule != "auto" and request.schedule not in SCHEDULES:
        raise ConfigError(f"schedule {request.schedule!r} is not supported; "
                          f"use one of auto, {', '.join(SCHEDULES)}")
    if request.virtual_stages is not None and (
            request.virtual_stages < 2 or request.schedule not in ("auto", "interleaved")):
        raise ConfigError(f"--virtual-stages {request.virtual_stages}: it sets the stages per "
                          "device of --schedule interleaved and must be 2 or more")
    if len(request.devices) != request.gpus:
        raise ConfigError(f"--hardware lists {len(request.devices)} devices but --gpus is "
                          f"{request.gpus}; list one device per GPU")


class _Costs:
    """The graph and the request, with every cost array cached: candidates share them."""

    def __init__(self, graph: CostGraph, request: PlanRequest) -> None:
        self.graph, self.request = graph, request
        self.legal = np.array(graph.legal_cuts)
        self.max_stages = int(self.legal[1:-1].sum()) + 1
        self.params = np.array([n.params for n in graph.nodes], dtype=float)
        self.param_bytes = np.array([n.param_bytes for n in graph.nodes], dtype=float)
        self._nodes: dict[tuple[Device, int], NodeArrays] = {}
        self._stages: dict[tuple[_Layout, int], _StageCosts] = {}
        self._bounds: dict[tuple[object, ...], tuple[int, ...] | None] = {}

    def nodes(self, device: Device, micro_batch: int) -> NodeArrays:
        key = (device, micro_batch)
        if key not in self._nodes:
            self._nodes[key] = node_arrays(self.graph, device, micro_batch,
                                           self.request.training, self.request.calibration)
        return self._nodes[key]

    def devices(self, layout: _Layout, position: int) -> list[Device]:
        """The distinct devices that run a pipeline position, one per replica."""
        ranks = [r * layout.pp + position for r in range(layout.dp)]
        return list(dict.fromkeys(self.request.devices[r] for r in ranks))

    def stages(self, layout: _Layout, micro_batch: int) -> _StageCosts:
        key = (layout, micro_batch)
        if key not in self._stages:
            self._stages[key] = self._stage_costs(layout, micro_batch)
        return self._stages[key]

    def _stage_costs(self, layout: _Layout, micro_batch: int) -> _StageCosts:
        # A position's replicas wait for each other (the all-reduce): node by node, the slowest.
        positions = [self.devices(layout, p) for p in range(layout.pp)]
        slowest = [[np.max([getattr(self.nodes(d, micro_batch), field) for d in devices], axis=0)
                    for field in ("fwd_s", "bwd_s")] for devices in positions]
        fwd = np.stack([slowest[k % layout.pp][0] for k in range(layout.stages)])
        bwd = np.stack([slowest[k % layout.pp][1] for k in range(layout.stages)])
        arrays = self.nodes(positions[0][0], micro_batch)
        cut = np.stack([self._cut_s(layout, arrays, k) for k in range(layout.stages)])
        capacity = tuple(min(usable_memory(d) for d in devices) for devices in positions)
        runtime = tuple(max(d.runtime_bytes for d in devices) for devices in positions)
        calibration = self.request.calibration
        overhead = calibration.stage_overhead_s if calibration else (0.0, 0.0)
        return _StageCosts(fwd + bwd, fwd, bwd, arrays, cut, capacity, runtime, overhead)

    def _cut_s(self, layout: _Layout, arrays: NodeArrays, stage: int) -> np.ndarray:
        """Stage → stage + 1 over the slowest link between the two positions' devices."""
        source, target = stage % layout.pp, (stage + 1) % layout.pp
        link = min(self.devices(layout, source) + self.devices(layout, target),
                   key=lambda d: d.intra_node_bandwidth)
        per_node = self.request.gpus // self.request.nodes
        return boundary_s(arrays.cut_bytes, link,
                          crosses_nodes(source, target, layout.pp, layout.dp, per_node))

    def fastest_work_s(self, micro_batch: int) -> float:
        """One micro-batch's forward + backward, every node on the fastest device for it."""
        times = [self.nodes(d, micro_batch) for d in set(self.request.devices)]
        return float(np.min([a.fwd_s + a.bwd_s for a in times], axis=0).sum())

    def boundaries(self, point: _Point, roles: tuple[StageRole, ...], balance: str
                   ) -> tuple[int, ...] | None:
        """Cached: a boundary rule without memory limits depends on fewer things."""
        key: tuple[object, ...] = (point.layout, balance)
        if balance != "uniform" and balance != "parameters":
            key += (point.micro_batch,)
        if balance == "pipec":
            key += (roles,)
        if key not in self._bounds:
            self._bounds[key] = (self._time_balance_if_it_fits(point, roles)
                                 if balance == "pipec" else None)
            if self._bounds[key] is None:
                self._bounds[key] = _boundaries(self, point, roles, balance)
        return self._bounds[key]

    def _time_balance_if_it_fits(self, point: _Point, roles: tuple[StageRole, ...]
                                 ) -> tuple[int, ...] | None:
        """The unconstrained optimum, when it fits the memory: then it is also the constrained
        optimum, and one DP serves every schedule of the point."""
        bounds = self.boundaries(point, roles, "time")
        assert bounds is not None
        sc = self.stages(point.layout, point.micro_batch)
        capacity = _stage_capacity(sc, point.layout)
        for (a, b), role in zip(itertools.pairwise(bounds), roles, strict=True):
            if stage_memory(sc.arrays, a, b, role).total > capacity[role.index]:
                return None
        return bounds


def _stage_capacity(sc: _StageCosts, layout: _Layout) -> tuple[float, ...]:
    """Per stage, the bytes it may use: its device's, less the runtime's own, shared equally
    by the device's stages (interleaved)."""
    return tuple((sc.capacity[k % layout.pp] - sc.runtime[k % layout.pp]) / layout.virtual
                 for k in range(layout.stages))


def _boundaries(costs: _Costs, point: _Point, roles: tuple[StageRole, ...], balance: str
                ) -> tuple[int, ...] | None:
    """``balance`` picks the boundaries: "pipec", the exact DP on time under each device's
    memory (None when nothing fits); "time", the same DP ignoring memory (torchgpipe's balance);
    "parameters", the DP on parameter counts (DeepSpeed's); "uniform", equal node counts."""
    layout = point.layout
    if balance == "uniform":
        return uniform_boundaries(costs.legal, layout.stages)
    sc = costs.stages(layout, point.micro_batch)
    unlimited = (float("inf"),) * layout.stages
    flights = tuple(role.in_flight for role in roles)
    if balance == "parameters":
        problem = make_problem(costs.params, sc.arrays.static_bytes, sc.arrays.activation_bytes,
                               np.zeros_like(sc.cut_s), costs.legal, unlimited, flights)
    elif balance == "time":
        problem = make_problem(sc.time_s, sc.arrays.static_bytes, sc.arrays.activation_bytes,
                               sc.cut_s, costs.legal, unlimited, flights)
    else:
        enter, leave = zip(*(ends_bytes(sc.arrays, role) for role in roles), strict=True)
        problem = make_problem(sc.time_s, sc.arrays.static_bytes, sc.arrays.activation_bytes,
                               sc.cut_s, costs.legal, _stage_capacity(sc, layout), flights,
                               np.stack(enter), np.stack(leave), sc.arrays.working_bytes)
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


def _device_splits(costs: _Costs) -> list[tuple[int, int]]:
    """(pp, dp) pairs to search: the one --pp gives, or every pp dividing the device count."""
    request = costs.request
    if request.pp is not None:
        return [_split_devices(costs, request.pp)]
    splits = [(pp, request.gpus // pp) for pp in range(1, request.gpus + 1)
              if request.gpus % pp == 0 and pp <= costs.max_stages
              and request.global_batch % (request.gpus // pp) == 0]
    if not splits:
        raise ConfigError(f"--batch-size {request.global_batch} is not divisible by any "
                          f"data-parallel degree of {request.gpus} devices that this model's "
                          f"{costs.max_stages} possible stages allow; use a multiple of "
                          f"{request.gpus}")
    return splits


def _split_devices(costs: _Costs, pp: int) -> tuple[int, int]:
    request = costs.request
    if request.gpus % pp:
        raise ConfigError(f"--pp {pp} does not divide --gpus {request.gpus}; "
                          "pipeline stages × data-parallel replicas must equal the device count")
    dp = request.gpus // pp
    if request.global_batch % dp:
        raise ConfigError(f"--batch-size {request.global_batch} is not divisible by the "
                          f"{dp} data-parallel replicas; use a multiple of {dp}")
    if pp > costs.max_stages:
        raise ConfigError(f"the model has {len(costs.graph.nodes)} nodes and only "
                          f"{costs.max_stages - 1} legal stage boundaries, so at most "
                          f"{costs.max_stages} stages; use --pp {costs.max_stages} or less")
    return pp, dp


def _pure_pipeline(costs: _Costs) -> tuple[int, int]:
    """The study's conventional setup: one pipeline over every device (or --pp's)."""
    request = costs.request
    pp = request.pp or max(p for p in range(1, min(request.gpus, costs.max_stages) + 1)
                           if request.gpus % p == 0
                           and request.global_batch % (request.gpus // p) == 0)
    return pp, request.gpus // pp


def _points(costs: _Costs, splits: list[tuple[int, int]]) -> list[_Point]:
    request = costs.request
    points = []
    for pp, dp in splits:
        replica_batch = request.global_batch // dp
        for m in _micro_batches(request, replica_batch):
            for schedule in _schedules(request):
                points += [_Point(_Layout(pp, dp, v), m, schedule)
                           for v in _virtuals(costs, schedule, pp)
                           if runs(schedule, pp, replica_batch // m, v)]
    if not points:
        raise _no_schedule(request, splits[-1][0])
    return points


def _no_schedule(request: PlanRequest, pp: int) -> ConfigError:
    if request.schedule == "interleaved":
        return ConfigError(f"--schedule interleaved needs 2 or more pipeline devices and a "
                           f"multiple of {pp} micro-batches per step, with {pp} × "
                           "--virtual-stages stages the model can be cut into; use a smaller "
                           "--micro-batch, another --pp or --schedule 1f1b")
    return ConfigError(f"--schedule {request.schedule} needs at least {pp} micro-batches per "
                       f"step (one per stage); use a smaller --micro-batch or --schedule gpipe")


def _micro_batches(request: PlanRequest, replica_batch: int) -> list[int]:
    if request.micro_batch is None:
        return [m for m in range(1, replica_batch + 1) if replica_batch % m == 0]
    if request.micro_batch < 1 or replica_batch % request.micro_batch:
        raise ConfigError(f"--micro-batch {request.micro_batch} does not divide the per-replica "
                          f"batch {replica_batch}; pick a divisor of {replica_batch}")
    return [request.micro_batch]


def _schedules(request: PlanRequest) -> tuple[str, ...]:
    return SCHEDULES if request.schedule == "auto" else (request.schedule,)


def _virtuals(costs: _Costs, schedule: str, pp: int) -> tuple[int, ...]:
    if schedule != "interleaved":
        return (1,)
    options = ((costs.request.virtual_stages,) if costs.request.virtual_stages
               else VIRTUAL_STAGES)
    return tuple(v for v in options if pp * v <= costs.max_stages)


def _search(costs: _Costs, points: list[_Point]
            ) -> tuple[_Evaluated | None, tuple[Candidate, ...], int]:
    """Branch and bound over the points: (the best that fits, the candidates evaluated, how many
    were pruned). Points that do not fit are reported with their time-balanced plan's memory."""
    bounds = {point: _lower_bound(costs, point) for point in points}
    ordered = sorted(points, key=lambda p: (bounds[p], _point_order(p)))
    best: _Evaluated | None = None
    evaluated: list[tuple[_Point, Candidate]] = []
    pruned = 0
    for i, point in enumerate(ordered):
        # Bounds and simulations sum the same times in different orders: leave a margin.
        if best is not None and bounds[point] * (1 - 1e-9) > best.iteration_s:
            pruned += len(ordered) - i
            break
        fitting = _partition(costs, point, "pipec")
        shown = fitting or _partition(costs, point, "time")
        assert shown is not None  # without a memory limit every legal partition is allowed
        if best is not None and _stage_bound_s(costs, shown) * (1 - 1e-9) > best.iteration_s:
            pruned += 1
            continue
        e = _timed(costs, shown)
        evaluated.append((point, _candidate(costs, e)))
        if fitting is not None and (best is None or _rank(e) < _rank(best)):
            best = e
    evaluated.sort(key=lambda pc: _point_order(pc[0]))
    return best, tuple(c for _, c in evaluated), pruned


def _point_order(point: _Point) -> tuple[int, int, int, int]:
    return (point.layout.pp, point.micro_batch, SCHEDULES.index(point.schedule),
            point.layout.virtual)


def _lower_bound(costs: _Costs, point: _Point) -> float:
    """No candidate is faster: the schedule's bound on the work at the fastest device's speed
    (schedule.lower_bound_s), then the all-reduce of 1/pp of the gradients over the fastest
    link."""
    layout = point.layout
    micro_batches = costs.request.global_batch // (layout.dp * point.micro_batch)
    fastest = max(costs.request.devices, key=lambda d: d.intra_node_bandwidth)
    return (lower_bound_s(costs.fastest_work_s(point.micro_batch), layout.pp, micro_batches,
                          layout.virtual)
            + allreduce_s(float(costs.param_bytes.sum()) / layout.pp, layout.dp, fastest))


def _rank(e: _Evaluated) -> tuple[float, float, int, int, int]:
    """Faster first; then less memory, a larger micro-batch, the earlier schedule, fewer stages."""
    return (e.iteration_s, max(e.memory), -e.micro_batch, SCHEDULES.index(e.schedule),
            e.layout.virtual)


def _evaluate(costs: _Costs, point: _Point, balance: str,
              batch: int | None = None) -> _Evaluated | None:
    """Partition and simulate one point (None when it does not fit, for "pipec")."""
    e = _partition(costs, point, balance, batch)
    return None if e is None else _timed(costs, e, batch)


def _partition(costs: _Costs, point: _Point, balance: str,
               batch: int | None = None) -> _Evaluated | None:
    """The boundaries and memory of one point, not yet simulated."""
    layout = point.layout
    micro_batches = (batch or costs.request.global_batch) // (layout.dp * point.micro_batch)
    flights = in_flight(point.schedule, layout.pp, micro_batches, layout.virtual)
    roles = tuple(StageRole(k, layout.stages, micro_batches, f, layout.dp)
                  for k, f in enumerate(flights))
    boundaries = costs.boundaries(point, roles, balance)
    if boundaries is None:
        return None
    sc = costs.stages(layout, point.micro_batch)
    stages = tuple(stage_memory(sc.arrays, a, b, role)
                   for (a, b), role in zip(itertools.pairwise(boundaries), roles, strict=True))
    memory = tuple(sum(m.total for m in stages[p::layout.pp]) + sc.runtime[p]
                   for p in range(layout.pp))
    return _Evaluated(point, boundaries, sc, memory, stages, None, float("nan"))


def _timed(costs: _Costs, e: _Evaluated, batch: int | None = None,
           timeline: bool = False) -> _Evaluated:
    """The simulated iteration: the schedule, then each position's gradient all-reduce."""
    if e.simulation is not None and (e.simulation.actions or not timeline):
        return e
    fwd, bwd = _stage_times(e)
    micro_batches = _micro_batch_count(costs, e, batch)
    simulation = simulate(e.schedule, fwd, bwd, micro_batches, e.layout.pp, timeline)
    return replace(e, simulation=simulation, iteration_s=simulation.iteration_s + _sync_s(costs, e))


def _stage_bound_s(costs: _Costs, e: _Evaluated) -> float:
    """A lower bound on the iteration time from the stage times, without simulating."""
    fwd, bwd = _stage_times(e)
    return (stage_lower_bound_s(fwd, bwd, _micro_batch_count(costs, e), e.layout.pp)
            + _sync_s(costs, e))


def _stage_times(e: _Evaluated) -> tuple[list[float], list[float]]:
    """Per stage, one micro-batch's forward and backward, each with half the boundary."""
    sc = e.costs
    spans = list(itertools.pairwise(e.boundaries))
    fwd = [_stage_fwd_s(sc, k, a, b) + float(sc.cut_s[k, b]) / 2
           for k, (a, b) in enumerate(spans)]
    bwd = [_stage_bwd_s(sc, k, a, b) + float(sc.cut_s[k, b]) / 2
           for k, (a, b) in enumerate(spans)]
    return fwd, bwd


def _stage_fwd_s(sc: _StageCosts, k: int, a: int, b: int) -> float:
    return float(sc.fwd_s[k, a:b].sum()) + sc.overhead_s[0]


def _stage_bwd_s(sc: _StageCosts, k: int, a: int, b: int) -> float:
    return float(sc.bwd_s[k, a:b].sum()) + sc.overhead_s[1]


def _micro_batch_count(costs: _Costs, e: _Evaluated, batch: int | None = None) -> int:
    return (batch or costs.request.global_batch) // (e.layout.dp * e.micro_batch)


def _sync_s(costs: _Costs, e: _Evaluated) -> float:
    """The slowest position's gradient all-reduce (all positions run theirs at once)."""
    spans = list(itertools.pairwise(e.boundaries))
    pp = e.layout.pp
    return max(_allreduce_s(costs, e.layout, p, spans[p::pp]) for p in range(pp))


def _allreduce_s(costs: _Costs, layout: _Layout, position: int,
                 spans: list[tuple[int, int]]) -> float:
    grad_bytes = sum(float(costs.param_bytes[a:b].sum()) for a, b in spans)
    link = min(costs.devices(layout, position), key=lambda d: d.intra_node_bandwidth)
    per_node = costs.request.gpus // costs.request.nodes
    return allreduce_s(grad_bytes, layout.dp, link,
                       spans_nodes(position, layout.pp, layout.dp, per_node))


def _unlimited(costs: _Costs, point: _Point, balance: str = "time") -> _Evaluated:
    """A candidate partitioned without a memory limit: always exists."""
    e = _evaluate(costs, point, balance)
    assert e is not None  # without a memory limit every legal partition is allowed
    return e


def _candidate(costs: _Costs, e: _Evaluated) -> Candidate:
    layout = e.layout
    return Candidate(e.micro_batch, costs.request.global_batch // (layout.dp * e.micro_batch),
                     e.schedule, costs.request.global_batch / e.iteration_s, max(e.memory),
                     e.fits(), layout.pp, layout.dp, layout.virtual)


@dataclass(frozen=True)
class _BaselineResult:
    summary: Baseline
    evaluated: _Evaluated


def _baseline(costs: _Costs, layout: _Layout, name: str) -> _BaselineResult:
    """A baseline on the given pp × dp: its boundary rule, and the best micro-batch and
    schedule for them (the fastest that fits, else the fastest); `conventional` is the study's:
    torchgpipe's time balance, GPipe, M = 4 · pp micro-batches, on one pipeline."""
    request = costs.request
    replica_batch = request.global_batch // layout.dp
    if name == "conventional":
        micro_batch = max(1, replica_batch // (4 * layout.pp))
        while replica_batch % micro_batch:
            micro_batch -= 1
        tried = [_unlimited(costs, _Point(layout, micro_batch, "gpipe"))]
    else:
        tried = [_unlimited(costs, _Point(layout, m, schedule), BALANCES[name])
                 for m in _micro_batches(request, replica_batch) for schedule in ("gpipe", "1f1b")
                 if runs(schedule, layout.pp, replica_batch // m)]
    fitting = [e for e in tried if e.fits()]
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
    return (request.micro_batch in (None, e.micro_batch) and request.pp in (None, e.layout.pp)
            and request.schedule in ("auto", e.schedule))


def _stage_plans(costs: _Costs, e: _Evaluated) -> tuple[StagePlan, ...]:
    return tuple(_stage_plan(costs, e, k, a, b)
                 for k, (a, b) in enumerate(itertools.pairwise(e.boundaries)))


def _stage_plan(costs: _Costs, e: _Evaluated, k: int, a: int, b: int) -> StagePlan:
    nodes = costs.graph.nodes[a:b]
    m, sc = e.micro_batch, e.costs
    fwd, bwd = _stage_fwd_s(sc, k, a, b), _stage_bwd_s(sc, k, a, b)
    compute = fwd + bwd
    return StagePlan(
        index=k, start=a, end=b, modules=_module_names([n.module for n in nodes]),
        params=sum(n.params for n in nodes),
        fwd_flops=sum(n.fwd_flops.at(m) for n in nodes),
        bwd_flops=sum(n.bwd_flops.at(m) for n in nodes),
        activation_bytes=float(sc.arrays.activation_bytes[a:b].sum()),
        memory_bytes=e.stage_memory[k].total,
        time_s=compute + float(sc.cut_s[k, b]),
        compute_s=compute,
        boundary_bytes=0.0 if b == len(costs.graph.nodes) else costs.graph.cut_bytes[b].at(m),
        device=k % e.layout.pp,
        fwd_s=fwd,
        bwd_s=bwd,
        memory=e.stage_memory[k],
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


def _max_batches(costs: _Costs, chosen: tuple[int, int], limit: int) -> tuple[MaxBatch, ...]:
    """pipec (any pp × dp it may pick) and each baseline (its own boundaries and pp × dp)."""
    methods: list[tuple[str, list[tuple[int, int]], str]] = [
        ("pipec", _device_splits(costs), "pipec")]
    methods += [(name, [chosen], balance) for name, balance in BALANCES.items()]
    methods.append(("conventional", [_pure_pipeline(costs)], "time"))
    return tuple(_max_batch(costs, name, options, balance, limit)
                 for name, options, balance in methods)


def _max_batch(costs: _Costs, method: str, splits: list[tuple[int, int]], balance: str,
               limit: int) -> MaxBatch:
    def fits(batch: int) -> bool:
        return any(_fits_batch(costs, method, pp, dp, balance, batch)
                   for pp, dp in splits if batch % (dp * (4 * pp if method == "conventional"
                                                          else 1)) == 0)
    # Batches tried: multiples of the device count (every split's dp divides it); conventional
    # needs 4 · pp micro-batches on each of its dp replicas.
    unit = (splits[0][1] * 4 * splits[0][0] if method == "conventional"
            else costs.request.gpus)
    if not fits(unit):
        return MaxBatch(method, 0, False)
    low, high = 1, 2  # in units
    while high * unit <= limit and fits(high * unit):
        low, high = high, high * 2
    if high * unit > limit:
        return MaxBatch(method, low * unit, low * unit * 2 > limit)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle * unit) else (low, middle)
    return MaxBatch(method, low * unit, False)


def _fits_batch(costs: _Costs, method: str, pp: int, dp: int, balance: str,
                batch: int) -> bool:
    """Whether ``method`` trains a global ``batch`` in memory in its leanest configuration:
    micro-batch 1 under 1F1B (or GPipe where 1F1B is not allowed); conventional: its own."""
    if method == "conventional":
        micro_batch, schedule = batch // (dp * 4 * pp), "gpipe"
    else:
        micro_batch = 1
        schedule = ("1f1b" if costs.request.schedule in ("auto", "1f1b")
                    and runs("1f1b", pp, batch // dp) else "gpipe")
    e = _partition(costs, _Point(_Layout(pp, dp), micro_batch, schedule), balance, batch)
    return e is not None and e.fits()


def _infeasible(costs: _Costs, pp: int, dp: int) -> InfeasibleError:
    request = costs.request
    schedule = "gpipe" if request.global_batch // dp < pp else "1f1b"
    e = _unlimited(costs, _Point(_Layout(pp, dp), 1, schedule))
    need = max(e.memory) / GIB
    have = min(e.costs.capacity) / GIB
    return InfeasibleError(
        f"the model needs {need:.2f} GiB on its fullest device even at micro-batch 1, have "
        f"{have:.2f} GiB usable on {request.hardware}; try more --gpus, a device with more "
        "memory (--hardware) or --optimizer sgd")
