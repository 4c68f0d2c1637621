"""The local shard of tensor-parallel regions: each rank's graph and weights.

A rank's graph is the model's with every shape constant a region splits divided by tp (a view's
head count, a split's sizes, repeat_kv's expand: pipec.frontend.shardable.ShapeRewrite); its
weights are the rank's rows of each column-parallel linear (for a fused projection, its part of
each piece) and columns of each row-parallel one. A row-parallel linear's output is then a
partial sum that one all-reduce completes (Shoeybi et al., 2019, §3).

The graph calls Megatron-LM's conjugate operations: *enter* (forward the identity, backward an
all-reduce of the gradient) on each value a region's column linears read, *reduce* (forward an
all-reduce, backward the identity) after each row-parallel linear, whose bias, whole on every
rank, is added after it, and *gather* (forward an all-gather along the last dimension, backward
the rank's slice) on each output the model returns split. A vocabulary-parallel embedding holds
the rank's rows and is looked up by a function that gives zeros for the others' rows and all-
reduces (Megatron-LM's VocabParallelEmbedding).

A region's random numbers (dropout of attention probabilities or of an MLP's hidden features)
fall on the rank's own heads or features, so each rank must draw its own: each such node runs
between *own_random* and *shared_random*, which switch to a stream of the rank's and back
(Megatron-LM's tensor-parallel random stream, Shoeybi et al., 2019, §3). Outside the regions
every rank draws alike, and its whole tensors stay equal.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import fx, nn

from pipec.frontend.shardable import Region, ShapeRewrite, VocabularyEmbedding

__all__ = ["EMITTED_COLLECTIVES", "Collectives", "TensorShard", "draws_random", "local_weights",
           "own_random_around", "parallel_graph", "stage_embeddings", "stage_regions",
           "stand_in", "tensor_shards"]


def _local_graph(gm: fx.GraphModule, regions: Sequence[Region], tp: int) -> fx.GraphModule:
    """A copy of ``gm`` (its submodules shared) with the shape constants of every rank's
    shard; the same for every rank."""
    graph = copy.deepcopy(gm.graph)
    nodes = {n.name: n for n in graph.nodes}
    for region in regions:
        for rewrite in region.rewrites:
            _rewrite(graph, nodes[rewrite.node], rewrite, tp)
    return fx.GraphModule(gm, graph, type(gm).__name__)


@dataclass(frozen=True)
class Collectives:
    """The functions ``parallel_graph`` calls (each takes and returns one tensor)."""

    enter: Callable[[torch.Tensor], torch.Tensor]
    reduce: Callable[[torch.Tensor], torch.Tensor]
    gather: Callable[[torch.Tensor], torch.Tensor]
    # A vocabulary-parallel lookup: (indices, the rank's rows, padding index or None), the
    # rows other ranks hold as zeros, all-reduced.
    embedding: Callable[..., torch.Tensor] | None = None
    # Around each node of a region that draws random numbers: before it, on its first input,
    # the switch to the rank's own stream; after it, on its output, the switch back. Each
    # returns its argument. None: every rank draws alike.
    own_random: Callable[[Any], Any] | None = None
    shared_random: Callable[[Any], Any] | None = None


def parallel_graph(gm: fx.GraphModule, regions: Sequence[Region], tp: int,
                   collectives: Collectives,
                   embeddings: Sequence[VocabularyEmbedding] = ()) -> fx.GraphModule:
    """A tp rank's graph: ``gm`` with its regions' shape constants divided and their
    collectives, and ``embeddings`` looked up vocabulary-parallel (the rank's weights:
    ``local_weights``)."""
    local = _local_graph(gm, regions, tp)
    graph = local.graph
    nodes = {n.name: n for n in graph.nodes}
    for embedding in embeddings:
        assert collectives.embedding is not None
        _vocabulary_parallel(local, nodes[embedding.node], collectives.embedding)
    for region in regions:
        _enter(graph, [nodes[c] for c in region.column_nodes], collectives.enter)
        for name in region.row_nodes:
            _reduce(local, nodes[name], collectives.reduce)
        for name in region.gathered:
            _after(graph, nodes[name], collectives.gather)
        if collectives.own_random is not None and collectives.shared_random is not None:
            for node in (nodes[n] for n in region.nodes if draws_random(local, nodes[n])):
                own_random_around(graph, node, collectives.own_random, collectives.shared_random)
    graph.lint()
    local.recompile()
    return local


# Modules and functions that draw random numbers (scaled_dot_product_attention: its dropout_p).
_RANDOM_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                   nn.FeatureAlphaDropout)
_RANDOM_NAMES = ("dropout", "bernoulli", "rand", "scaled_dot_product")


def draws_random(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` may draw random numbers: a dropout module, or a function or method
    (torch's or aten's) whose name says so."""
    if node.op == "call_module":
        return isinstance(gm.get_submodule(str(node.target)), _RANDOM_MODULES)
    if node.op not in ("call_function", "call_method"):
        return False
    name = str(node.target) if node.op == "call_method" else \
        getattr(node.target, "__name__", str(node.target))
    return any(word in name for word in _RANDOM_NAMES)


def own_random_around(graph: fx.Graph, node: fx.Node, own: Callable[[Any], Any],
                shared: Callable[[Any], Any]) -> None:
    """``node`` run on the rank's own random stream: ``own`` on its first input before it,
    ``shared`` on its output after it (each returns its argument, so the graph orders them)."""
    if not node.all_input_nodes:
        return  # draws for no input of the graph's (a shape's random tensor): left alone
    first = node.all_input_nodes[0]
    with graph.inserting_before(node):
        switched = graph.call_function(own, (first,))
    node.args, node.kwargs = fx.node.map_arg(
        (node.args, node.kwargs), lambda a: switched if a is first else a)
    _after(graph, node, shared)


def _vocabulary_parallel(gm: fx.GraphModule, node: fx.Node,
                         lookup: Callable[..., torch.Tensor]) -> None:
    """``node`` (nn.Embedding's call or aten.embedding) as ``lookup(indices, weight,
    padding index or None)``."""
    graph = gm.graph
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        with graph.inserting_before(node):
            weight: Any = graph.get_attr(f"{node.target}.weight")
        indices, padding = node.args[0], module.padding_idx
    else:
        weight, indices = node.args[0], node.args[1]
        padding = node.args[2] if len(node.args) > 2 and node.args[2] != -1 else None
    node.op, node.target = "call_function", lookup
    node.args, node.kwargs = (indices, weight, padding), {}


def _enter(graph: fx.Graph, columns: list[fx.Node], enter: Callable[..., Any]) -> None:
    """One *enter* per value the columns read, placed before its first reader."""
    entered: dict[fx.Node, fx.Node] = {}
    for column in columns:
        value = column.args[0]
        assert isinstance(value, fx.Node)
        if value not in entered:
            with graph.inserting_before(column):
                entered[value] = graph.call_function(enter, (value,))
        column.args = (entered[value], *column.args[1:])


def _reduce(gm: fx.GraphModule, row: fx.Node, reduce: Callable[..., Any]) -> None:
    """The row linear without its bias, the all-reduce, then the bias."""
    graph = gm.graph
    bias: Any = None
    if row.op == "call_module":
        path = str(row.target)
        with graph.inserting_before(row):
            weight = graph.get_attr(path + ".weight")
            if gm.get_submodule(path).bias is not None:
                bias = graph.get_attr(path + ".bias")
        row.op, row.target = "call_function", torch.nn.functional.linear
        row.args, row.kwargs = (row.args[0], weight), {}
    elif len(row.args) > 2 or "bias" in row.kwargs:
        bias = row.args[2] if len(row.args) > 2 else row.kwargs["bias"]
        row.args, row.kwargs = row.args[:2], {}
    reduced = _after(graph, row, reduce)
    if bias is not None:
        # In the output's dtype, as the linear adds it (bf16 under autocast).
        with graph.inserting_after(reduced):
            cast = graph.call_method("type_as", (bias, reduced))
        with graph.inserting_after(cast):
            added = graph.call_function(operator.add, (reduced, cast))
        reduced.replace_all_uses_with(added, delete_user_cb=lambda user: user not in (cast,
                                                                                       added))


def _after(graph: fx.Graph, node: fx.Node, function: Callable[..., Any], *more: Any
           ) -> fx.Node:
    """``function(node, *more)`` placed after ``node``, which its users now read."""
    with graph.inserting_after(node):
        new = graph.call_function(function, (node, *more))
    node.replace_all_uses_with(new, delete_user_cb=lambda user: user is not new)
    return new


def _rewrite(graph: fx.Graph, node: fx.Node, rewrite: ShapeRewrite, tp: int) -> None:
    if rewrite.position == "split":
        size = node.args[1]
        local = [s // tp for s in size] if isinstance(size, list | tuple) else int(size) // tp
        node.args = (node.args[0], local, *node.args[2:])  # type: ignore[arg-type]
        return
    listed = len(node.args) == 2 and isinstance(node.args[1], list | tuple)
    sizes = list(node.args[1] if listed else node.args[1:])  # type: ignore[arg-type]
    position = int(rewrite.position)
    sizes[position] = _divided(graph, node, sizes[position], tp)
    node.args = (node.args[0], sizes) if listed else (node.args[0], *sizes)


def _divided(graph: fx.Graph, before: fx.Node, size: Any, tp: int) -> Any:
    """``size // tp``: a constant computed now, a traced size as a node; -1 stays -1."""
    if isinstance(size, fx.Node):
        with graph.inserting_before(before):
            return graph.call_function(operator.floordiv, (size, tp))
    return size if size == -1 else int(size) // tp


@dataclass(frozen=True)
class TensorShard:
    """A tensor each tp rank holds a part of: along ``dim`` (0, a column-parallel linear's
    weight and bias; 1, a row-parallel one's weight), the rank's part of each piece."""

    name: str  # the state-dict key
    dim: int
    pieces: tuple[int, ...]  # sizes along ``dim``, summing to the whole


def tensor_shards(shapes: Mapping[str, Sequence[int]], regions: Sequence[Region],
                  embeddings: Sequence[VocabularyEmbedding] = ()) -> tuple[TensorShard, ...]:
    """The tensors of ``shapes`` (state-dict key → whole shape) that ``regions`` and the
    vocabulary-parallel ``embeddings`` shard."""
    shards = [TensorShard(e.path + ".weight", 0, (e.rows,)) for e in embeddings]
    for region in regions:
        fused = dict(region.fused)
        for path in region.columns:
            pieces = tuple(fused.get(path, (shapes[path + ".weight"][0],)))
            shards += [TensorShard(name, 0, pieces) for name in (path + ".weight", path + ".bias")
                       if name in shapes]
        shards += [TensorShard(path + ".weight", 1, (shapes[path + ".weight"][1],))
                   for path in region.rows]
    return tuple(shards)


def local_weights(state: Mapping[str, torch.Tensor], regions: Sequence[Region], tp: int,
                  rank: int, embeddings: Sequence[VocabularyEmbedding] = ()
                  ) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tensors of ``state`` (the whole model's state dict): the linears of
    ``regions`` and the rows of ``embeddings`` sharded, everything else (row-parallel biases
    included) as it is."""
    local = dict(state)
    for shard in tensor_shards({k: v.shape for k, v in state.items()}, regions, embeddings):
        pieces = state[shard.name].split(list(shard.pieces), dim=shard.dim)
        local[shard.name] = torch.cat([p.chunk(tp, dim=shard.dim)[rank] for p in pieces],
                                      dim=shard.dim).contiguous()
    return local


def stage_embeddings(embeddings: Sequence[VocabularyEmbedding], names: Mapping[str, str]
                     ) -> tuple[VocabularyEmbedding, ...]:
    """The embeddings a stage looks up, their nodes named as the stage's graph names them."""
    return tuple(replace(e, node=names[e.node]) for e in embeddings if e.node in names)


def stage_regions(regions: Sequence[Region], names: Mapping[str, str]) -> tuple[Region, ...]:
    """The regions whose nodes a stage holds, their node names as the stage's graph has them
    (``names``: the model graph's name → the stage's). A region is never cut by a stage
    boundary (the planner forbids such cuts)."""
    inside = [r for r in regions if r.nodes[0] in names]
    for region in inside:
        missing = [n for n in region.nodes if n not in names]
        assert not missing, f"a stage boundary cuts a tensor-parallel region at {missing[0]}"
    return tuple(replace(
        r, nodes=tuple(names[n] for n in r.nodes),
        rewrites=tuple(replace(w, node=names[w.node]) for w in r.rewrites),
        gathered=tuple(names[n] for n in r.gathered),
        column_nodes=tuple(names[n] for n in r.column_nodes),
        row_nodes=tuple(names[n] for n in r.row_nodes)) for r in inside)


def stand_in(name: str) -> Callable[..., torch.Tensor]:
    """A collective the emitted tensor_parallel.py defines, under the name the emitted stages
    import from there."""
    def collective(*values: Any) -> torch.Tensor:
        raise AssertionError(f"{name} runs only in the emitted tensor_parallel.py")
    collective.__name__ = collective.__qualname__ = name
    collective.__module__ = "tensor_parallel"
    return collective


# The collectives the emitted stages call (pipec.codegen.split): tensor_parallel.py's.
EMITTED_COLLECTIVES = Collectives(stand_in("enter"), stand_in("reduce"), stand_in("gather"),
                                  stand_in("vocabulary_embedding"), stand_in("own_random"),
                                  stand_in("shared_random"))
