"""The search over tensor parallelism: pp × dp plans of one tp rank's costs, for each tp degree.

A tp group holds one copy of the model's pipeline position and replica: tp ranks that run the
same stage, each with its shard of the sharded regions (pipec.cost.sharded_costs). With tp
innermost in the device mesh the group is tp consecutive devices of one node, so the pipeline
and the replicas see ``gpus / tp`` devices: each is planned as today on the rank's costs, and
the fastest degree wins. tp divides the devices of a node (its collectives run on the
intra-node link) and every sharded region's heads and features.

Sequence parallelism between the regions is an option of each degree's plan (the emitted
script applies it: pipec.codegen.sequence_parallel).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from pipec.cost.sharded_costs import shard_costs
from pipec.errors import InfeasibleError
from pipec.frontend.costgraph import CostGraph
from pipec.frontend.shardable import Shardable
from pipec.planning.planner import plan
from pipec.planning.values import Plan, PlanRequest

__all__ = ["SequenceSplit", "TpPlan", "fastest_at", "plan_at", "plan_with_tp", "tp_degrees",
           "tp_groups"]

# The nodes split along the sequence: named, every node outside the regions (True), or none.
SequenceSplit = bool | frozenset[str]


@dataclass(frozen=True)
class TpPlan:
    tp: int
    plan: Plan  # one tp rank's pp × dp plan over gpus / tp devices
    tried: tuple[tuple[int, float | None], ...]  # each degree and its samples/s (None: no fit)

    @property
    def samples_per_s(self) -> float:
        return self.plan.samples_per_s


def tp_degrees(shardable: Shardable, request: PlanRequest, limit: int | None = None
               ) -> tuple[int, ...]:
    """The degrees that divide a node's devices (at most ``limit``), whose remaining devices
    divide the batch's replicas, and at which some region shards."""
    per_node = request.gpus // request.nodes
    return tuple(tp for tp in range(1, per_node + 1)
                 if per_node % tp == 0 and (limit is None or tp <= limit)
                 and (tp == 1 or shardable.regions_at(tp)))


def plan_with_tp(graph: CostGraph, shardable: Shardable, request: PlanRequest,
                 degrees: tuple[int, ...],
                 sequence_parallel: Callable[[int], tuple[SequenceSplit, ...]] = lambda tp: (True,)
                 ) -> TpPlan:
    """The fastest plan over ``degrees``, each with the faster of its ``sequence_parallel``
    options; an InfeasibleError, the last degree's, when none fits."""
    tried: list[tuple[int, float | None]] = []
    best: tuple[int, Plan] | None = None
    error: InfeasibleError | None = None
    for tp in degrees:
        try:
            found = fastest_at(graph, shardable, request, tp, sequence_parallel(tp))
        except InfeasibleError as exc:
            tried.append((tp, None))
            error = exc
            continue
        tried.append((tp, found.samples_per_s))
        if best is None or found.samples_per_s > best[1].samples_per_s:
            best = (tp, found)
    if best is None:
        raise error or InfeasibleError("no tp degree to try")
    return TpPlan(best[0], best[1], tuple(tried))


def fastest_at(graph: CostGraph, shardable: Shardable, request: PlanRequest, tp: int,
               options: tuple[SequenceSplit, ...]) -> Plan:
    """The fastest of ``tp``'s plans with each sequence-parallel option (the first of equals);
    the last option's InfeasibleError when none fits. Sequence parallelism saves memory and
    the nodes' time between the regions, but blocks twice as often: which wins depends on the
    link's latency."""
    best: Plan | None = None
    error: InfeasibleError | None = None
    for option in options:
        try:
            found = plan_at(graph, shardable, request, tp, option)
        except InfeasibleError as exc:
            error = exc
            continue
        if best is None or found.samples_per_s > best.samples_per_s:
            best = found
    if best is None:
        raise error or InfeasibleError("no sequence-parallel option to try")
    return best


def plan_at(graph: CostGraph, shardable: Shardable, request: PlanRequest, tp: int,
            sequence_parallel: SequenceSplit = True) -> Plan:
    """One tp rank's plan over ``request.gpus / tp`` devices, one per tp group; sequence
    parallelism between the regions (Megatron-LM's with tp: the same bytes communicated, 1/tp
    of the activations between regions) on the nodes ``sequence_parallel`` names, by default
    on every node outside them."""
    costs = shard_costs(graph, shardable.regions_at(tp), tp, shardable.embeddings_at(tp),
                        sequence_parallel)
    return plan(costs.graph, tp_groups(request, tp, bool(sequence_parallel)))


def tp_groups(request: PlanRequest, tp: int, sequence_parallel: bool = False) -> PlanRequest:
    """The request the pipeline and the replicas see: one device per tp group."""
    return replace(request, gpus=request.gpus // tp, devices=request.devices[::tp], tp=tp,
                   sequence_parallel=sequence_parallel)
