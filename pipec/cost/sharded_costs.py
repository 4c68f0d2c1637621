"""What one tensor-parallel rank computes, holds and communicates.

Inside a region every node works on 1/tp of the features or heads, so its FLOPs, weights,
saved activations and outputs are divided by tp, with two exceptions: a row-parallel linear's
output is whole (the all-reduce completes it) and a column-parallel linear saves its whole
input for its weight gradient. The collectives follow Megatron-LM (Shoeybi et al., 2019, §3):
per region and micro-batch, an all-reduce of each row-parallel output in forward and of the
gradient of each value the column linears read in backward; a gathered output (the LM head's
logits) is all-gathered in forward. Nodes outside the regions are replicated: every rank runs
them whole.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from pipec.cost.hardware import Device
from pipec.cost.model import allreduce_bandwidth, allreduce_s
from pipec.frontend.costgraph import CostGraph, Linear, NodeCost
from pipec.frontend.shardable import Region

__all__ = ["TpCosts", "shard_costs", "tp_collective_s"]

_NONE = Linear(0.0, 0.0)


@dataclass(frozen=True)
class TpCosts:
    tp: int
    graph: CostGraph  # one rank's costs
    forward_bytes: tuple[Linear, ...]  # per node: all-reduced after its forward
    backward_bytes: tuple[Linear, ...]  # per node: all-reduced in its backward
    gathered_bytes: tuple[Linear, ...]  # per node: all-gathered after its forward (whole size)

    def per_sample_bytes(self) -> tuple[float, float]:
        """Bytes all-reduced (or gathered) per sample, forward and backward."""
        forward = sum(b.per_sample for b in (*self.forward_bytes, *self.gathered_bytes))
        return forward, sum(b.per_sample for b in self.backward_bytes)


def shard_costs(graph: CostGraph, regions: Sequence[Region], tp: int,
                embeddings: Sequence[str] = ()) -> TpCosts:
    """One rank's costs when ``regions`` (those that allow ``tp``) shard over ``tp`` ranks,
    and ``embeddings`` (their nodes) by vocabulary: a rank holds 1/tp of the rows, looks up
    the tokens in its range, and an all-reduce sums the ranks' outputs (Megatron-LM's
    VocabParallelEmbedding)."""
    if any(not r.allows(tp) for r in regions):
        raise ValueError(f"a region does not shard over {tp} ranks")
    inside = {name for r in regions for name in r.nodes}
    rows = {name: bias for r in regions for name, bias in zip(r.row_nodes, r.row_bias,
                                                                strict=True)}
    columns = {name for r in regions for name in r.column_nodes}
    gathered = {name for r in regions for name in r.gathered}
    outputs = {n.name: n.output_bytes for n in graph.nodes}
    reduced = {r.column_nodes[0]: _total(outputs.get(value, _NONE) for value in r.inputs)
               for r in regions}
    nodes = tuple(_shard(n, tp, rows.get(n.name), n.name in columns) if n.name in inside
                  else _vocabulary_shard(n, tp) if n.name in embeddings else n
                  for n in graph.nodes)
    reduced_outputs = set(rows) | set(embeddings)
    return TpCosts(
        tp, replace(graph, nodes=nodes),
        tuple(n.output_bytes if n.name in reduced_outputs else _NONE for n in graph.nodes),
        tuple(reduced.get(n.name, _NONE) for n in graph.nodes),
        tuple(n.output_bytes if n.name in gathered else _NONE for n in graph.nodes))


def _total(quantities: Iterable[Linear]) -> Linear:
    """The gradients a region's column linears read, all-reduced at its first one (a graph
    input has no gradient: it is no node's output)."""
    items = list(quantities)
    return Linear(sum(q.fixed for q in items), sum(q.per_sample for q in items))


def _shard(node: NodeCost, tp: int, row_bias: int | None, column: bool) -> NodeCost:
    """``row_bias``: the node is row-parallel, with a bias of this many values (0: none),
    whole on every rank."""
    def split(quantity: Linear) -> Linear:
        return Linear(quantity.fixed / tp, quantity.per_sample / tp)

    row = row_bias is not None
    bias = row_bias or 0
    item = node.param_bytes // max(node.params, 1)
    return replace(
        node, fwd_flops=split(node.fwd_flops), bwd_flops=split(node.bwd_flops),
        output_bytes=node.output_bytes if row else split(node.output_bytes),
        saved_bytes=node.saved_bytes if column else split(node.saved_bytes),
        working_bytes=split(node.working_bytes), selective_bytes=split(node.selective_bytes),
        params=(node.params - bias) // tp + bias,
        param_bytes=((node.params - bias) // tp + bias) * item,
        shared_bytes=node.shared_bytes // tp)


def _vocabulary_shard(node: NodeCost, tp: int) -> NodeCost:
    item = node.param_bytes // max(node.params, 1)
    return replace(node, params=node.params // tp, param_bytes=node.params // tp * item,
                   shared_bytes=node.shared_bytes // tp)


def tp_collective_s(costs: TpCosts, micro_batch: int, device: Device, bytes_ratio: float = 1.0
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Each node's forward and backward collective time at ``micro_batch`` over the intra-node
    link (tp stays within a node); ``bytes_ratio`` 0.5 for bf16 activations."""
    def reduce(quantities: Sequence[Linear]) -> np.ndarray:
        return np.array([allreduce_s(q.at(micro_batch) * bytes_ratio, costs.tp, device)
                         if q != _NONE else 0.0 for q in quantities])

    gather = np.array([_allgather_s(q.at(micro_batch) * bytes_ratio, costs.tp, device)
                       for q in costs.gathered_bytes])
    return reduce(costs.forward_bytes) + gather, reduce(costs.backward_bytes)


def _allgather_s(whole_bytes: float, ranks: int, device: Device) -> float:
    """Ring all-gather: d−1 steps, each moving 1/d of the whole (Patarasuk & Yuan 2009)."""
    if ranks == 1 or whole_bytes == 0:
        return 0.0
    steps = ranks - 1
    return (steps * device.intra_node_latency_s
            + steps / ranks * whole_bytes / allreduce_bandwidth(device))
