"""One point: its stage boundaries and memory (``partition``), then its simulated iteration
(``timed``): the schedule, then each pipeline position's gradient all-reduce."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import numpy as np

from pipec.cost.hardware import for_replicas
from pipec.cost.model import (
    allreduce_bandwidth,
    allreduce_s,
    data_parallel_collectives,
    optimizer_s,
    spans_nodes,
)
from pipec.cost.stage_memory import StageMemory, StageRole, stage_memory
from pipec.planning.balance import Balance, boundaries
from pipec.planning.device_peak import apart_bytes
from pipec.planning.points import Costs, Layout, Point, StageCosts
from pipec.planning.schedules import (
    HOLDS_SENDS,
    SCHEDULES,
    ZERO_BUBBLE,
    awaiting_weights,
    in_flight,
)
from pipec.planning.sharding import (
    BLOCK,
    SHARDED,
    collective_count,
    collectives_s,
    gathered_ratio,
)
from pipec.planning.simulate import Simulation, simulate, stage_lower_bound_s
from pipec.planning.values import PlanRequest


@dataclass(frozen=True)
class Evaluated:
    """A point partitioned: its boundaries and memory; its iteration time once ``timed``."""

    point: Point
    boundaries: tuple[int, ...]
    stage_costs: StageCosts
    num_micro_batches: int  # per replica and step
    memory: tuple[float, ...]  # per position, the runtime's own bytes included
    stage_memory: tuple[StageMemory, ...]  # per stage
    recompute: tuple[str, ...]  # per stage: "none", "selective" or "full" (recomputation)
    iteration_s: float = float("nan")  # nan until ``timed``: only the memory was needed

    @property
    def layout(self) -> Layout:
        return self.point.layout

    @property
    def micro_batch(self) -> int:
        return self.point.micro_batch

    @property
    def schedule(self) -> str:
        return self.point.schedule

    def fits(self) -> bool:
        return all(m <= c for m, c in zip(self.memory, self.stage_costs.capacity, strict=True))


def partition(costs: Costs, point: Point, balance: Balance, batch: int | None = None,
              recompute_all: bool = False) -> Evaluated | None:
    """The boundaries and memory of one point at the global ``batch`` (default: the
    request's), not yet simulated, every stage recomputing where it may and that holds less if
    ``recompute_all``; None when ``balance`` finds nothing that fits."""
    layout = point.layout
    micro_batches = (batch or costs.request.global_batch) // (layout.dp * point.micro_batch)
    flights = in_flight(point.schedule, layout.pp, micro_batches, layout.virtual)
    awaiting = awaiting_weights(point.schedule, layout.pp, micro_batches, layout.virtual)
    # Synthetic data is made whole in the process's memory: the device's own on a CPU.
    whole_batch = costs.graph.synthetic_data and all(
        d.device_type == "cpu" for d in costs.request.devices)
    holds_sends = point.schedule in HOLDS_SENDS
    roles = tuple(StageRole(k, layout.stages, micro_batches, f, layout.dp, whole_batch,
                            holds_sends, layout.position(k) == layout.position(0), w)
                  for k, (f, w) in enumerate(zip(flights, awaiting, strict=True)))
    placed = boundaries(costs, point, roles, balance)
    if placed is None:
        return None
    bounds, recompute = placed
    sc = costs.stages(layout, point.micro_batch)
    if recompute_all:  # where it may and it holds less (not on a stage with one in flight)
        unrecomputable = costs.unrecomputable(layout)
        recompute = tuple(
            "full" if not unrecomputable[a:b].any()
            and stage_memory(sc.arrays, a, b, role, "full").total
            < stage_memory(sc.arrays, a, b, role).total else "none"
            for (a, b), role in zip(itertools.pairwise(bounds), roles, strict=True))
    stages = _kernels_once_per_device(sc, layout, bounds, tuple(
        stage_memory(sc.arrays, a, b, role, again)
        for (a, b), role, again in zip(itertools.pairwise(bounds), roles, recompute,
                                       strict=True)))
    apart = apart_bytes(point.schedule, layout.pp, micro_batches, layout.virtual, stages,
                        recompute)
    memory = tuple(sum(stages[k].total for k in layout.stages_on(p)) + sc.runtime[p] - apart[p]
                   for p in range(layout.pp))
    return Evaluated(point, bounds, sc, micro_batches, memory, stages, recompute)


def _kernels_once_per_device(sc: StageCosts, layout: Layout, bounds: tuple[int, ...],
                             stages: tuple[StageMemory, ...]) -> tuple[StageMemory, ...]:
    """The math library keeps its kernels per process: a stage on a device that already ran a
    call (an earlier stage of it, interleaved or in a V) holds no second copy of its kernel."""
    kernels = sc.arrays.kernels
    if not kernels.held or layout.virtual == 1:
        return stages
    seen: dict[int, set[int]] = {p: set() for p in range(layout.pp)}
    fixed = []
    for k, memory in enumerate(stages):
        calls = kernels.calls(bounds[k], bounds[k + 1]) - seen[layout.position(k)]
        seen[layout.position(k)] |= calls
        fixed.append(replace(memory, kernels=kernels.bytes_of(calls)))
    return tuple(fixed)


def timed(costs: Costs, e: Evaluated) -> Evaluated:
    """``e`` with its iteration time: the simulated schedule (no timeline: the search needs only
    the figures), then the slowest position's gradient all-reduce."""
    simulation = _simulate(e, timeline=False)
    return replace(e, iteration_s=simulation.iteration_s + sum(step_terms(costs, e).values()))


def step_terms(costs: Costs, e: Evaluated) -> dict[str, float]:
    """What a step takes besides its schedule (plan.json ``predicted.step_terms``): the
    gradient all-reduce (under FSDP, its all-gathers and reduce-scatter), then the optimizer
    step, making the step's data and the runtime's own time per step, each the slowest
    position's."""
    return {"all_reduce": sync_s(costs, e), "optimizer": _optimizer_s(costs, e),
            "data": data_s(costs), "runtime": step_overhead_s(costs)}


def synchronized_norm_s(e: Evaluated) -> float:
    """What a step of the slowest position waits for its synchronized BatchNorms' all-reduces
    (plan.json ``predicted.synchronized_norm_s``), inside its stages' times."""
    per_node = e.stage_costs.synchronized_norm_s
    if per_node is None:
        return 0.0
    spans = list(itertools.pairwise(e.boundaries))
    return e.num_micro_batches * max(sum(float(per_node[a:b].sum())
                                         for a, b in _spans_on(e, spans, p))
                                     for p in range(e.layout.pp))


def step_overhead_s(costs: Costs) -> float:
    """The runtime's own time per optimizer step (the slowest device's)."""
    return max(d.step_overhead_s for d in costs.request.devices)


def data_s(costs: Costs) -> float:
    """The model file's sample_batch for the global batch (train.py makes it whole on every
    rank that reads data, then takes its replica's share), as measured (0: not measured)."""
    calibration = costs.request.calibration
    if calibration is None:
        return 0.0
    fixed, per_sample = calibration.data_s
    return fixed + per_sample * costs.request.global_batch


def _optimizer_s(costs: Costs, e: Evaluated) -> float:
    """The slowest position's optimizer step: over its shard of the weights under FSDP (every
    tensor sharded, none fewer), as measured on the device where it was."""
    spans = list(itertools.pairwise(e.boundaries))
    optimizer = costs.request.training.optimizer
    shard = e.layout.dp if e.layout.fsdp in SHARDED else 1

    def on(p: int, per_node: np.ndarray) -> float:
        return sum(float(per_node[a:b].sum()) for a, b in _spans_on(e, spans, p))

    return max(optimizer_s(on(p, costs.param_bytes) / shard, optimizer,
                           min(costs.devices(e.layout, p), key=lambda d: d.memory_bandwidth),
                           on(p, costs.param_tensors), costs.request.calibration)
               for p in range(e.layout.pp))


def _spans_on(e: Evaluated, spans: list[tuple[int, int]], position: int
              ) -> list[tuple[int, int]]:
    return [spans[k] for k in e.layout.stages_on(position)]


def timeline(e: Evaluated) -> Simulation:
    """``e``'s schedule simulated again, keeping every action (the timeline picture); its times
    are those ``timed`` found."""
    return _simulate(e, timeline=True)


def _simulate(e: Evaluated, timeline: bool) -> Simulation:
    fwd, bwd = stage_times(e, boundary=False)
    cores, late, links = e.stage_costs.cores, e.stage_costs.late_receive_s, transfer_s(e)
    if e.schedule not in ZERO_BUBBLE:
        return simulate(e.schedule, fwd, bwd, e.num_micro_batches, e.layout.pp, timeline,
                        cores=cores, late_receive_s=late, transfer_s=links)
    # The weights' gradient is an action of its own, and splitting costs both halves time.
    between = e.stage_costs.extra_action_s(e.schedule)  # the weights' action's, beyond its call
    bwd = [b + extra + between for b, extra in zip(bwd, split_backward_s(e), strict=True)]
    weights = [w + s / 2 for w, s in zip(stage_weight_s(e), _split_s(e), strict=True)]
    return simulate(e.schedule, fwd, bwd, e.num_micro_batches, e.layout.pp, timeline, weights,
                    cores, late, links)


def transfer_s(e: Evaluated) -> tuple[list[float], list[float]]:
    """Per stage, one way, the link's time for what its forward sends to the next stage and
    its backward to the one before (StageCosts.cut_s holds both ways). The simulation puts it
    between the send and the arrival, not in the sender's action: torch's runtime posts a
    send and goes on (1F1B waits for it together with its next receive), and a send to a
    receiver not yet asking starts only when it asks (gloo's rendezvous).
    benchmarks/studies/link_side.py measures this against charging the sender
    (docs/cost-model.md)."""
    cut, spans = e.stage_costs.cut_s, list(itertools.pairwise(e.boundaries))
    forward = [float(cut[k, b]) / 2 for k, (_, b) in enumerate(spans)]
    backward = [float(cut[k - 1, a]) / 2 if k else 0.0 for k, (a, _) in enumerate(spans)]
    return forward, backward


def split_backward_s(e: Evaluated) -> list[float]:
    """Per stage, what a zero-bubble schedule's backward calls take beyond stage_bwd_s: the
    weights' gradient's own call and the split (0 under the other schedules). The runtime's
    time between actions is the schedule's, not the calls'."""
    if e.schedule not in ZERO_BUBBLE:
        return [0.0] * e.layout.stages
    return [e.stage_costs.overhead_s[1] + s for s in _split_s(e)]


def stage_weight_s(e: Evaluated) -> list[float]:
    """Per stage, one micro-batch's weights' gradient, the action's own overhead included."""
    sc = e.stage_costs
    shares = sc.weight_s if sc.weight_s is not None else sc.bwd_s / 2
    return [float(shares[k, a:b].sum()) + sc.overhead_s[1] + sc.extra_action_s(e.schedule)
            for k, (a, b) in enumerate(itertools.pairwise(e.boundaries))]


def _split_s(e: Evaluated) -> list[float]:
    """Per stage, what splitting its backward adds per micro-batch (StageCosts.split_s), half
    to each of its two actions; nothing on the first stage, whose input needs no gradient:
    torch runs its backward whole, in the weights' action."""
    split = e.stage_costs.split_s
    return [0.0 if split is None or k == 0 else float(split[a:b].sum())
            for k, (a, b) in enumerate(itertools.pairwise(e.boundaries))]


def unlimited(costs: Costs, point: Point, balance: Balance,
              recompute_all: bool = False) -> Evaluated:
    """A point partitioned by a balance without a memory limit, and timed: always exists."""
    e = partition(costs, point, balance, recompute_all=recompute_all)
    assert e is not None  # without a memory limit every legal partition is allowed
    return timed(costs, e)


def rank(e: Evaluated) -> tuple[float, float, int, int, int]:
    """Faster first; then less memory, a larger micro-batch, the earlier schedule, fewer stages."""
    return (e.iteration_s, max(e.memory), -e.micro_batch, SCHEDULES.index(e.schedule),
            e.layout.virtual)


def stage_bound_s(costs: Costs, e: Evaluated) -> float:
    """A lower bound on the iteration time from the stage times, without simulating (the
    boundaries' transfers only lengthen it: on the link, not in a device's actions)."""
    fwd, bwd = stage_times(e, boundary=False)
    bound = stage_lower_bound_s(fwd, bwd, e.num_micro_batches, e.layout.pp, e.schedule)
    cores = e.stage_costs.cores
    if cores is not None and cores.shared:
        bound = cores.bound_s(bound, e.num_micro_batches * (sum(fwd) + sum(bwd)) / e.layout.pp)
    return bound + sum(step_terms(costs, e).values())


def stage_times(e: Evaluated, boundary: bool = True) -> tuple[list[float], list[float]]:
    """Per stage, one micro-batch's forward and backward (a recomputing stage's backward runs
    its forward again), each with half the boundary unless the link carries it
    (``boundary=False``: the simulation's, transfer_s)."""
    sc = e.stage_costs
    spans = list(itertools.pairwise(e.boundaries))
    share = 0.5 if boundary else 0.0
    fwd = [stage_fwd_s(sc, k, a, b, e.schedule, e.recompute[k]) + float(sc.cut_s[k, b]) * share
           for k, (a, b) in enumerate(spans)]
    bwd = [stage_bwd_s(sc, k, a, b, e.recompute[k], e.schedule) + float(sc.cut_s[k, b]) * share
           for k, (a, b) in enumerate(spans)]
    return fwd, bwd


def stage_fwd_s(sc: StageCosts, k: int, a: int, b: int, schedule: str = "",
                recompute: str = "none") -> float:
    """Stage k's forward over nodes [a, b), one micro-batch, the stage's own overhead and,
    under ``schedule``, the runtime's around it included (StageCosts.between_s; and selective
    recomputation's pass)."""
    selective = (float(sc.selective_pass_s[a:b].sum())
                 if recompute == "selective" and sc.selective_pass_s is not None else 0.0)
    return (float(sc.fwd_s[k, a:b].sum()) + selective + sc.overhead_s[0]
            + sc.between_s(schedule, k))


def stage_bwd_s(sc: StageCosts, k: int, a: int, b: int, recompute: str = "none",
                schedule: str = "") -> float:
    """Stage k's backward over nodes [a, b), one micro-batch, the stage's own overhead and,
    under ``schedule``, the runtime's around it included; when it ``recompute``s, with its
    nodes' forward again (selective: of the nodes whose outputs it does not keep)."""
    again = (0.0 if recompute == "none" else float(sc.fwd_s[k, a:b].sum()) if recompute == "full"
             else float(sc.selective_again_s[k, a:b].sum()))
    return float(sc.bwd_s[k, a:b].sum()) + again + sc.overhead_s[1] + sc.between_s(schedule, k)


def sync_s(costs: Costs, e: Evaluated) -> float:
    """The slowest position's data-parallel collectives (all positions run theirs at once):
    the gradient all-reduce, or FSDP's all-gathers and reduce-scatter."""
    if e.layout.dp == 1:
        return 0.0
    spans = list(itertools.pairwise(e.boundaries))
    fwd, bwd = stage_times(e)
    return max(_collectives_s(costs, e, p, _spans_on(e, spans, p),
                              _unsynchronized_s(e, p, spans, fwd, bwd))
               for p in range(e.layout.pp))


def _unsynchronized_s(e: Evaluated, position: int, spans: list[tuple[int, int]],
                      fwd: list[float], bwd: list[float]) -> float:
    """The compute a position's replicas run between two steps' all-reduces without waiting
    for each other: the whole step's, unless synchronized BatchNorms make them wait (whose
    waits the stages' times hold: synchronized_norm_s; the little after the last is left)."""
    synchronized = e.stage_costs.synchronized_norm_s
    if synchronized is not None and any(synchronized[a:b].any()
                                        for a, b in _spans_on(e, spans, position)):
        return 0.0
    return e.num_micro_batches * sum(fwd[k] + bwd[k] for k in e.layout.stages_on(position))


def group_figures_used(request: PlanRequest, pp: int, dp: int, replicas_inner: bool) -> bool:
    """Whether some position's replicas pay their group's own data-parallel figures
    (Device.replica_collectives, measured for ``dp`` replicas), as _collectives_s charges them:
    only a group within a node."""
    per_node = request.gpus // request.nodes
    return dp >= 2 and any(for_replicas(d, dp) is not d for d in request.devices) and any(
        not spans_nodes(p, pp, dp, per_node, replicas_inner) for p in range(pp))


def _collectives_s(costs: Costs, e: Evaluated, position: int,
                   spans: list[tuple[int, int]], compute_s: float) -> float:
    """One position's collectives, each also paying the wait a collective after compute has
    (Device.step_collective_s, measured within a node), and once a step the data-parallel
    runtime's work per gradient tensor (Device.gradient_tensor_s, the host's, wherever the
    replicas are) and the lead one replica takes on the other over the step's ``compute_s``
    since the last step's collectives, as an all-reduce in a pass waits for it
    (Device.blocking_drift · √T). Both are measured with DDP; FSDP2 pays them too (its hooks
    copy each parameter in and out, and its replicas meet at its collectives as DDP's do;
    docs/cost-model.md, "A data-parallel step")."""
    layout = e.layout
    per_node = costs.request.gpus // costs.request.nodes
    inter_node = spans_nodes(position, layout.pp, layout.dp, per_node, layout.replicas_inner)
    # Within a node, the figures of a group of dp replicas where measured apart: the step's
    # last all-reduce, the first position's, runs while the other positions wait.
    link = min((d if inter_node else for_replicas(d, layout.dp)
                for d in costs.devices(layout, position)), key=allreduce_bandwidth)
    wait = 0.0 if inter_node else link.step_collective_s
    lead = 0.0 if inter_node else link.blocking_drift * math.sqrt(compute_s)
    tensors = sum(float(costs.param_tensors[a:b].sum()) for a, b in spans)
    once_a_step = tensors * link.gradient_tensor_s + lead
    if layout.fsdp in SHARDED:
        weights = sum(float(costs.weight_bytes[a:b].sum()) for a, b in spans)
        block = layout.fsdp == BLOCK
        units = costs.units_in(spans) if block else 1
        recomputing = any(e.recompute[k] != "none" for k in layout.stages_on(position))
        return (collectives_s(layout.fsdp, weights, e.num_micro_batches, layout.dp, link,
                              inter_node, gathered_ratio(costs.request.training)
                              if block else 1.0, recomputing)
                + collective_count(layout.fsdp, e.num_micro_batches, units, recomputing) * wait
                + once_a_step)
    grad_bytes = sum(float(costs.param_bytes[a:b].sum()) for a, b in spans)
    return (allreduce_s(grad_bytes, layout.dp, link, inter_node)
            + data_parallel_collectives(grad_bytes) * wait + once_a_step)
