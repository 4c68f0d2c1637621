"""What one tensor-parallel rank computes, holds and communicates.

Inside a region every node works on 1/tp of the features or heads, so its FLOPs, weights, saved
activations and outputs are divided by tp, with two exceptions: a row-parallel linear's output
is whole (the all-reduce completes it), and under bf16 a column-parallel linear keeps a bf16
copy of its whole input for its weight gradient (in fp32 the whole input it keeps is its
producer's output, outside the region). The collectives follow Megatron-LM (Shoeybi et al.,
2019, §3): per region and micro-batch, an all-reduce of each row-parallel output in forward and
of the gradient of each value the column linears read in backward. A gathered output (the LM
head's logits) is all-gathered in forward: a ring all-gather moves half an all-reduce's bytes,
so it is counted as an all-reduce of half its size. An embedding whose rows tp divides is
vocabulary-parallel (Megatron-LM's VocabParallelEmbedding): a rank holds 1/tp of the rows and
its output is all-reduced. A stage boundary may not cut a region: the values inside are split.

Nodes outside the regions (norms, residual adds, dropout) are replicated: every rank runs them
whole, unless ``sequence_parallel``: then each rank runs them on 1/tp of the sequence, and each
all-reduce becomes a reduce-scatter after the row-parallel linear and an all-gather before the
column-parallel ones, which move the same bytes (Korthikanti et al., 2022, §4.2.2). Their
FLOPs, saved activations and outputs are then 1/tp, and so are the bytes of such a value that
crosses a stage boundary (the emitted stages send a rank's part: pipec.codegen.sequence_parallel);
the loss still sees the gathered logits.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from pipec.frontend.costgraph import CostGraph, Linear, NodeCost
from pipec.frontend.shardable import Region

__all__ = ["TpCosts", "shard_costs"]

_NONE = Linear(0.0, 0.0)


@dataclass(frozen=True)
class TpCosts:
    tp: int
    graph: CostGraph  # one rank's costs, its collectives in each node's tp_*_bytes

    def per_sample_bytes(self) -> tuple[float, float]:
        """Bytes all-reduced per sample, forward and backward."""
        return (sum(n.tp_forward_bytes.per_sample for n in self.graph.nodes),
                sum(n.tp_backward_bytes.per_sample for n in self.graph.nodes))


def shard_costs(graph: CostGraph, regions: Sequence[Region], tp: int,
                embeddings: Sequence[str] = (),
                sequence_parallel: bool | Collection[str] = False) -> TpCosts:
    """One rank's costs when ``regions`` (those that allow ``tp``) and ``embeddings`` (their
    nodes) shard over ``tp`` ranks, and ``sequence_parallel``'s nodes along the sequence (True:
    every other node, the most it could give)."""
    if any(not r.allows(tp) for r in regions):
        raise ValueError(f"a region does not shard over {tp} ranks")
    if tp == 1:
        return TpCosts(1, graph)
    inside = {name for r in regions for name in r.nodes}
    rows = {name: bias for r in regions
            for name, bias in zip(r.row_nodes, r.row_bias, strict=True)}
    columns = {name for r in regions for name in r.column_nodes}
    gathered = {name for r in regions for name in r.gathered}
    outputs = {n.name: n.output_bytes for n in graph.nodes}
    backward = {r.column_nodes[0]: _total(outputs.get(v, _NONE) for v in r.inputs)
                for r in regions}
    entered = {v for r in regions for v in r.inputs}
    nodes = []
    for n in graph.nodes:
        forward = _forward_bytes(n, n.name in rows or n.name in embeddings, n.name in gathered)
        if n.name in rows or n.name in embeddings:
            # The rank's graph reads their weights and calls F.linear or the lookup
            # (pipec.codegen.local_shards), not the module: no FSDP unit of theirs runs.
            n = replace(n, op="call_function")
        if n.name in inside:
            n = _shard(n, tp, rows.get(n.name), n.name in columns, n.name in gathered)
            if sequence_parallel and n.name in backward:
                n = _keeps_gathered_input(n, backward[n.name])
        elif n.name in embeddings:
            n = _weights(n, tp)
        elif sequence_parallel is True or (sequence_parallel and n.name in sequence_parallel):
            n = _split_work(n, tp)
            if n.name in entered:
                n = _output_not_kept(n)
        collectives = (forward, backward.get(n.name, _NONE))
        if sequence_parallel:
            collectives = _sequence_collectives(n.name, collectives, rows, backward)
        nodes.append(replace(n, tp_forward_bytes=collectives[0],
                             tp_backward_bytes=collectives[1]))
    split = inside - set(rows) - gathered  # whole after their all-reduce or all-gather
    legal = tuple(ok and not (i < len(graph.live) and split & set(graph.live[i]))
                  for i, ok in enumerate(graph.legal_cuts))
    sharded = replace(graph, nodes=tuple(nodes), legal_cuts=legal, tp=tp)
    if sequence_parallel:
        along = ({n.name for n in graph.nodes} - inside - set(embeddings)
                 if sequence_parallel is True else set(sequence_parallel))
        sharded = _boundaries_split(sharded, outputs, along, tp)
    return TpCosts(tp, sharded)


def _boundaries_split(graph: CostGraph, outputs: Mapping[str, Linear], along: Collection[str],
                      tp: int) -> CostGraph:
    """``graph`` with the values split ``along`` the sequence crossing each cut at 1/tp of
    their bytes (each cut's four byte counts scaled by the share of its per-sample bytes those
    values hold)."""
    kept = []
    for names, whole in zip(graph.live, graph.cut_bytes, strict=False):
        part = sum(outputs[v].per_sample for v in names if v in along and v in outputs)
        share = part / whole.per_sample if whole.per_sample > 0 else 0.0
        kept.append(1.0 - min(share, 1.0) * (1.0 - 1.0 / tp))

    def scaled(values: tuple[Linear, ...]) -> tuple[Linear, ...]:
        return tuple(Linear(v.fixed * k, v.per_sample * k)
                     for v, k in zip(values, kept, strict=False)) + values[len(kept):]

    return replace(graph, cut_bytes=scaled(graph.cut_bytes),
                   held_cut_bytes=scaled(graph.held_cut_bytes),
                   cut_bytes_bf16=scaled(graph.cut_bytes_bf16),
                   held_cut_bytes_bf16=scaled(graph.held_cut_bytes_bf16))


def _split(quantity: Linear, tp: int) -> Linear:
    return Linear(quantity.fixed / tp, quantity.per_sample / tp)


def _split_work(node: NodeCost, tp: int) -> NodeCost:
    """``node`` on 1/tp of its features, heads or sequence: its FLOPs and activations."""
    bf16 = node.bf16 if node.bf16.saved_bytes is None else replace(
        node.bf16, saved_bytes=_split(node.bf16.saved_bytes, tp))
    return replace(node, fwd_flops=_split(node.fwd_flops, tp), bf16=bf16,
                   bwd_flops=_split(node.bwd_flops, tp),
                   output_bytes=_split(node.output_bytes, tp),
                   saved_bytes=_split(node.saved_bytes, tp),
                   working_bytes=_split(node.working_bytes, tp),
                   selective_bytes=_split(node.selective_bytes, tp))


def _sequence_collectives(name: str, all_reduces: tuple[Linear, Linear],
                          rows: Mapping[str, int], entries: Mapping[str, Linear]
                          ) -> tuple[Linear, Linear]:
    """A node's collectives under sequence parallelism, as bytes of an all-reduce of the same
    cost (a ring's all-gather or reduce-scatter moves half an all-reduce's): a region's entry
    all-gathers the sequence forward and reduce-scatters its gradient backward, a row-parallel
    linear reduce-scatters forward and all-gathers backward. The bytes are the all-reduces',
    but each region blocks twice as often, forward and backward
    (benchmarks/results/tp_step_time.md measures what that costs on gloo)."""
    if name in rows:
        half = _split(all_reduces[0], 2)
        return half, half
    if name in entries:  # and, for the head, its logits' all-gather forward
        half = _split(entries[name], 2)
        return _total((half, all_reduces[0])), half
    return all_reduces


def _output_not_kept(node: NodeCost) -> NodeCost:
    """A split node whose output only a region reads: the region keeps the sequence gathered
    from it (counted at its first column linear), and nothing keeps the part itself."""
    kept = Linear(max(node.saved_bytes.fixed - node.output_bytes.fixed, 0.0),
                  max(node.saved_bytes.per_sample - node.output_bytes.per_sample, 0.0))
    return replace(node, saved_bytes=kept)


def _keeps_gathered_input(column: NodeCost, whole_input: Linear) -> NodeCost:
    """A region's first column linear under sequence parallelism: its input is the sequence
    all-gathered on entry, a whole copy it keeps for its weights' gradient (in fp32; under bf16
    it keeps autocast's bf16 copy, already counted, and the fp32 gather is freed)."""
    bf16 = column.bf16 if column.bf16.saved_bytes is not None else replace(
        column.bf16, saved_bytes=_split(column.saved_bytes, 2))
    saved = Linear(column.saved_bytes.fixed + whole_input.fixed,
                   column.saved_bytes.per_sample + whole_input.per_sample)
    return replace(column, saved_bytes=saved, bf16=bf16)


def _forward_bytes(node: NodeCost, reduced: bool, gathered: bool) -> Linear:
    if reduced:
        return node.output_bytes
    if gathered:
        return _split(node.output_bytes, 2)
    return _NONE


def _total(quantities: Iterable[Linear]) -> Linear:
    """The gradients a region's column linears read, all-reduced at its first one (a graph
    input has no gradient: it is no node's output)."""
    items = list(quantities)
    return Linear(sum(q.fixed for q in items), sum(q.per_sample for q in items))


def _shard(node: NodeCost, tp: int, row_bias: int | None, column: bool,
           gathered: bool = False) -> NodeCost:
    """``row_bias``: the node is row-parallel, with a bias of this many values (0: none),
    whole on every rank, as is its output, and a ``gathered`` one's (the whole logits the
    loss reads, all-gathered from the ranks' parts). A node's saved bytes are what it allocates and
    autograd keeps (its output, kept by its users): 1/tp of them, but under bf16 a
    column-parallel linear also keeps the bf16 copy of its whole input, and its bytes there
    stay whole (an upper bound: its output's share is counted whole too)."""
    split = _split_work(node, tp)
    whole_output = row_bias is not None or gathered
    split = replace(split, output_bytes=node.output_bytes if whole_output
                    else split.output_bytes, bf16=node.bf16 if column else split.bf16,
                    product_split=1 if row_bias is not None else tp)
    return _weights(split, tp, whole=row_bias or 0)


def _weights(node: NodeCost, tp: int, whole: int = 0) -> NodeCost:
    """The node's parameters on one rank: 1/tp of them, but ``whole`` of them on every rank
    (a vocabulary-parallel embedding: none)."""
    params = (node.params - whole) // tp + whole
    return replace(node, params=params,
                   param_bytes=params * (node.param_bytes // max(node.params, 1)),
                   shared_bytes=node.shared_bytes // tp)
