"""Tensor-parallel regions of a traced graph: which linears shard by column and by row, and why
the others stay whole.

Megatron-LM's split (Shoeybi et al., 2019, §3): a linear that reads a whole (replicated)
activation shards its output features over the tp ranks (column-parallel); the values derived
from that output stay sharded along the same dimension through elementwise operations, head
reshapes and attention, until a linear reads them along its input features (row-parallel) and
an all-reduce makes its output whole again. A *region* is one such set of column and row
linears with everything between them: an MLP, a gated MLP, an attention block (GQA included: the
key/value heads shard like the query heads), or an LM head whose sharded output is gathered.

The analysis propagates a sharding state forward through the graph, once per pass: each node
with a sharded input either keeps a sharded output (the dimension moved by views, transposes and
splits) or is a *conflict*: an operation the split cannot cross (a residual add of the sharded
value, a reduction over the sharded dimension, a read of its shape). The region of a conflict
stays whole (its column linears replicated) and the propagation runs again, until no conflict
is left. Works on both graph forms pipec traces: torch.fx's module calls and torch.export's
aten operators.
"""

from __future__ import annotations

import collections
import math
import operator
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

__all__ = ["Region", "ShapeRewrite", "Shardable", "VocabularyEmbedding", "WholeLinear",
           "find_shardable"]


@dataclass(frozen=True)
class ShapeRewrite:
    """A shape constant the local shard needs divided by tp: the ``position``-th size of a
    view, reshape or expand (a head count), or every size of a split ("split")."""

    node: str
    position: int | str


@dataclass(frozen=True)
class Region:
    kind: str  # "attention", "gated MLP", "MLP" or "head"
    columns: tuple[str, ...]  # column-parallel linears (their weights' module paths)
    rows: tuple[str, ...]  # row-parallel linears, each followed by an all-reduce
    nodes: tuple[str, ...]  # graph nodes inside, in graph order, the linears included
    rewrites: tuple[ShapeRewrite, ...]
    sizes: tuple[int, ...]  # sizes the tp degree must divide (features, heads)
    gathered: tuple[str, ...] = ()  # sharded values the model returns, all-gathered
    # Column linears whose output is split into pieces that shard on their own (a fused q/k/v
    # projection): path, the pieces' sizes. Rank r holds the r-th part of each piece.
    fused: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # The values the column linears read: each one's gradient is all-reduced in backward.
    inputs: tuple[str, ...] = ()
    column_nodes: tuple[str, ...] = ()  # the graph nodes of ``columns`` and ``rows``
    row_nodes: tuple[str, ...] = ()
    row_bias: tuple[int, ...] = ()  # each row-parallel linear's bias, whole on every rank

    def allows(self, tp: int) -> bool:
        return all(size % tp == 0 for size in self.sizes)

    def blocker(self, tp: int) -> int | None:
        """The first size ``tp`` does not divide (None: it shards)."""
        return next((size for size in self.sizes if size % tp), None)


@dataclass(frozen=True)
class WholeLinear:
    """A linear (or embedding) that stays replicated, and the node that stops its split."""

    path: str
    reason: str


@dataclass(frozen=True)
class VocabularyEmbedding:
    """An embedding that can shard its rows over the tp ranks (vocabulary-parallel)."""

    path: str
    rows: int
    node: str


@dataclass(frozen=True)
class Shardable:
    regions: tuple[Region, ...]
    vocabulary: tuple[VocabularyEmbedding, ...]
    whole: tuple[WholeLinear, ...]

    def degrees(self, limit: int) -> tuple[int, ...]:
        """The tp degrees up to ``limit`` that every region allows."""
        return tuple(tp for tp in range(1, limit + 1)
                     if all(r.allows(tp) for r in self.regions))

    def regions_at(self, tp: int) -> tuple[Region, ...]:
        """The regions that shard over ``tp`` ranks; the others stay whole."""
        return tuple(r for r in self.regions if r.allows(tp))

    def vocabulary_at(self, tp: int) -> tuple[VocabularyEmbedding, ...]:
        """The embeddings whose rows ``tp`` divides (none at tp 1)."""
        return tuple(e for e in self.vocabulary if tp > 1 and e.rows % tp == 0)

    def embeddings_at(self, tp: int) -> tuple[str, ...]:
        """The graph nodes of the embeddings whose rows ``tp`` divides."""
        return tuple(e.node for e in self.vocabulary_at(tp))


@dataclass(frozen=True)
class _Shard:
    """A value split over the tp ranks along ``dim``; ``pieces`` are the full sizes of the
    blocks along it (a fused q/k/v projection has three, each split on its own)."""

    dim: int
    pieces: tuple[int, ...]
    region: int
    column: str = ""  # the column linear whose output this is, through elementwise operations


class _Conflict(Exception):
    pass


_MODULE_OPS = {"Linear": "linear", "Embedding": "embedding", "GELU": "unary", "ReLU": "unary",
               "SiLU": "unary", "Tanh": "unary", "Sigmoid": "unary", "Dropout": "unary",
               "Identity": "unary", "Softmax": "softmax"}
_UNARY = {"gelu", "relu", "silu", "tanh", "sigmoid", "dropout", "neg", "to", "type", "float",
          "half", "bfloat16", "contiguous", "clone", "alias", "to_copy", "type_as", "exp",
          "native_dropout", "unary", "erf", "square"}
_BINARY = {"add", "sub", "mul", "div", "truediv", "iadd", "imul", "masked_fill", "where"}
_VIEWS = {"view", "reshape", "unsafe_view"}
_SPLITS = {"split", "chunk", "split_with_sizes", "unbind"}
_ATTENTION = {"scaled_dot_product_attention", "scaled_dot_product_flash_attention_for_cpu",
              "scaled_dot_product_flash_attention", "scaled_dot_product_efficient_attention"}
_MATMULS = {"matmul", "bmm"}


def op_name(gm: fx.GraphModule, node: fx.Node) -> str:
    """One name per operation across torch.fx's and torch.export's spellings."""
    if node.op == "call_module":
        return _MODULE_OPS.get(type(gm.get_submodule(str(node.target))).__name__, "module")
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_function":
        name = str(getattr(node.target, "__name__", node.target))
        return str(name.split(".")[0].strip("_"))
    return str(node.op)


def find_shardable(gm: fx.GraphModule, shapes: Mapping[str, tuple[int, ...]]) -> Shardable:
    """The tensor-parallel regions of ``gm``, given each tensor node's output shape (any batch
    size: only the feature and head dimensions matter)."""
    kept = _tied_linears(gm)  # column linear node -> why it stays whole
    while True:
        propagation = _Propagation(gm, shapes, frozenset(kept))
        propagation.run()
        failed = propagation.failures()
        if not failed:
            return propagation.result(kept)
        kept.update(failed)


@dataclass
class _RegionParts:
    columns: list[str] = field(default_factory=list)
    rows: list[str] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    rewrites: list[ShapeRewrite] = field(default_factory=list)
    sizes: set[int] = field(default_factory=set)
    gathered: list[str] = field(default_factory=list)
    fused: dict[str, tuple[int, ...]] = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)
    row_bias: list[int] = field(default_factory=list)
    attention: bool = False


class _Propagation:
    """One forward pass of the sharding state over the graph."""

    def __init__(self, gm: fx.GraphModule, shapes: Mapping[str, tuple[int, ...]],
                 kept: frozenset[str]) -> None:
        self.gm, self.shapes, self.kept = gm, shapes, kept
        self.nodes = {n.name: n for n in gm.graph.nodes}
        self.state: dict[fx.Node, Any] = {}  # a _Shard, or a list of them for a tuple
        self.parent: list[int] = []
        self.parts: list[_RegionParts] = []
        self.conflicts: dict[int, str] = {}  # region -> the first conflict's reason
        self.trained = _trained_values(gm)

    def run(self) -> None:
        for node in self.gm.graph.nodes:
            self._visit(node)

    def _visit(self, node: fx.Node) -> None:
        op = op_name(self.gm, node)
        if op == "linear":
            self._linear(node)
            return
        sharded = [n for n in node.all_input_nodes if n in self.state]
        if not sharded:
            return
        if node.op == "output":
            for n in sharded:
                self._parts(n).gathered.append(n.name)
            return
        try:
            result = self._rule(op, node)
        except _Conflict as conflict:
            for n in sharded:
                for region in self._regions_of(self.state[n]):
                    self.conflicts.setdefault(self._root(region),
                                              f"{node.name} ({op}) {conflict}")
            return
        self.state[node] = result
        first = next(iter(self._regions_of(result)))
        for n in sharded:
            for region in self._regions_of(self.state[n]):
                self._union(first, region)
        self._parts(node).nodes.append(node.name)
        self._parts(node).attention |= op in _ATTENTION or op == "softmax"

    # -- linears ---------------------------------------------------------------------------

    def _linear(self, node: fx.Node) -> None:
        x = node.args[0]
        state = self.state.get(x) if isinstance(x, fx.Node) else None
        try:
            out_features, in_features = self._weight_shape(node)
        except _Conflict as conflict:  # a weight computed in forward (a transposed tie)
            if state is not None:
                self.conflicts.setdefault(self._root(_first_region(state)),
                                          f"{node.name} (linear) {conflict}")
            return
        if state is None:
            if node.name in self.kept:
                return
            region = self._new_region()
            self.state[node] = _Shard(len(self.shapes[node.name]) - 1, (out_features,), region,
                                      node.name)
            parts = self.parts[region]
            parts.columns.append(node.name)
            parts.nodes.append(node.name)
            if isinstance(x, fx.Node):
                parts.inputs.append(x.name)
            parts.sizes.add(out_features)
            return
        if not isinstance(state, _Shard) or state.dim != len(self.shapes[x.name]) - 1 \
                or len(state.pieces) != 1:
            self.conflicts.setdefault(self._root(_first_region(state)),
                                      f"{node.name} (linear) reads the value split along "
                                      "another dimension than its input features")
            return
        if node.name in self.kept:
            self.conflicts.setdefault(self._root(_first_region(state)),
                                      f"{node.name} (linear) has a tied weight")
            return
        parts = self._parts(x)
        parts.rows.append(node.name)
        parts.row_bias.append(out_features if self._has_bias(node) else 0)
        parts.nodes.append(node.name)
        parts.sizes.add(in_features)

    def _has_bias(self, node: fx.Node) -> bool:
        if node.op == "call_module":
            return self.gm.get_submodule(str(node.target)).bias is not None
        return _arg(node, 2, "bias") is not None

    def _weight_shape(self, node: fx.Node) -> tuple[int, int]:
        if node.op == "call_module":
            weight = self.gm.get_submodule(str(node.target)).weight
        else:
            weight = _attribute(self.gm, node.args[1])
        return int(weight.shape[0]), int(weight.shape[1])

    # -- the rules -------------------------------------------------------------------------

    def _rule(self, op: str, node: fx.Node) -> Any:
        if op in _UNARY:
            return self._unary(node)
        if op in _BINARY:
            return self._broadcast(node, _tensor_args(node))
        if op in _VIEWS:
            return self._view(node)
        handler = {"expand": self._expand, "unsqueeze": self._unsqueeze,
                   "transpose": self._transpose, "permute": self._permute,
                   "getitem": self._getitem, "slice": self._slice, "cat": self._cat,
                   "softmax": self._softmax, "flatten": self._view}.get(op)
        if handler is not None:
            return handler(node)
        if op in _SPLITS:
            return self._split(node, op)
        if op in _ATTENTION:
            return self._attention(node, op)
        if op in _MATMULS:
            return self._broadcast(node, _tensor_args(node), matmul=True)
        raise _Conflict("uses the split value: no tensor-parallel rule for this operation")

    def _input(self, node: fx.Node) -> _Shard:
        state = self.state.get(node.args[0]) if isinstance(node.args[0], fx.Node) else None
        if not isinstance(state, _Shard):
            raise _Conflict("splits its input on a value it does not read first")
        return state

    def _unary(self, node: fx.Node) -> _Shard:
        args = _tensor_args(node)
        if len(args) > 1:
            return self._broadcast(node, args)
        return self._input(node)  # keeps ``column``: a fused projection may still be split

    def _broadcast(self, node: fx.Node, args: Sequence[fx.Node], matmul: bool = False,
                   rank: int | None = None, grouped: bool = False) -> _Shard:
        """Elementwise (or batched matrix product) operands: every split one along the same
        output dimension, every whole one of size 1 there (a mask, cos/sin broadcast over
        heads). ``grouped``: attention's keys and values may have fewer heads than its queries
        (grouped-query attention), each count split over the same ranks."""
        rank = rank if rank is not None else len(self.shapes[node.name])
        shards = [(a, self.state[a]) for a in args if a in self.state]
        dims = {s.dim + rank - len(self.shapes[a.name]) for a, s in shards}
        pieces = {s.pieces for _, s in shards[:1 if grouped else None]}
        if len(dims) != 1 or len(pieces) != 1:
            raise _Conflict("combines values split along different dimensions")
        dim = dims.pop()
        if matmul and dim >= rank - 2:
            raise _Conflict("contracts or returns the split dimension")
        for whole in (a for a in args if a not in self.state):
            shape = self.shapes.get(whole.name, ())
            position = dim - (rank - len(shape))
            if position >= 0 and shape[position] != 1:
                raise _Conflict(f"combines the split value with {whole.name}, whole along "
                                "the split dimension")
            if whole in self.trained:  # each rank would make a part of its gradient
                raise _Conflict(f"combines the split value with {whole.name}, made from "
                                "trained parameters")
        return _Shard(dim, pieces.pop(), shards[0][1].region)

    def _view(self, node: fx.Node) -> _Shard:
        """A reshape keeps the split on the outermost of the dimensions it splits the split
        one into (heads of a projection) or merges it with (heads back into features)."""
        state = self._input(node)
        source, target = self.shapes[_first_node(node).name], self.shapes[node.name]
        size, prefix = source[state.dim], math.prod(source[:state.dim])
        dim = next((d for d in range(len(target)) if math.prod(target[:d]) == prefix
                    and (_spans(target, d, size) or _spans(source, state.dim, target[d]))),
                   None)
        if dim is None:
            raise _Conflict("reshapes the split dimension across others")
        pieces = state.pieces
        if len(pieces) > 1 and target[dim] == len(pieces) and len(set(pieces)) == 1 \
                and _spans(target, dim + 1, pieces[0]):
            dim, pieces = dim + 1, (pieces[0],)  # fused q/k/v: a dimension of the three
        elif len(pieces) > 1:
            raise _Conflict("reshapes a fused projection's output")
        if op_name(self.gm, node) != "flatten":  # flatten names no sizes
            self._parts_of(state).rewrites.append(_size_rewrite(node, dim, len(target)))
        self._parts_of(state).sizes.add(target[dim])
        return _Shard(dim, (target[dim],), state.region)

    def _expand(self, node: fx.Node) -> _Shard:
        state = self._input(node)
        offset = len(self.shapes[node.name]) - len(self.shapes[_first_node(node).name])
        self._parts_of(state).rewrites.append(
            _size_rewrite(node, state.dim + offset, len(self.shapes[node.name])))
        return _Shard(state.dim + offset, state.pieces, state.region)

    def _unsqueeze(self, node: fx.Node) -> _Shard:
        state = self._input(node)
        at = _normalized(_arg(node, 1, "dim"), len(self.shapes[node.name]))
        return _Shard(state.dim + (at <= state.dim), state.pieces, state.region)

    def _transpose(self, node: fx.Node) -> _Shard:
        state = self._input(node)
        rank = len(self.shapes[node.name])
        a, b = (_normalized(_arg(node, i, name), rank) for i, name in ((1, "dim0"), (2, "dim1")))
        dim = b if state.dim == a else a if state.dim == b else state.dim
        return _Shard(dim, state.pieces, state.region)

    def _permute(self, node: fx.Node) -> _Shard:
        state = self._input(node)
        order = node.args[1:] if node.op == "call_method" and len(node.args) > 2 \
            else _arg(node, 1, "dims")
        rank = len(self.shapes[node.name])
        normalized = [_normalized(d, rank) for d in order]
        return _Shard(normalized.index(state.dim), state.pieces, state.region)

    def _softmax(self, node: fx.Node) -> _Shard:
        state = self._input(node)
        if node.op == "call_module":
            dim = self.gm.get_submodule(str(node.target)).dim
        else:
            dim = _arg(node, 1, "dim")
        if _normalized(dim, len(self.shapes[node.name])) == state.dim:
            raise _Conflict("normalizes over the split dimension")
        return state

    def _slice(self, node: fx.Node) -> _Shard:
        state = self._input(node)
        rank = len(self.shapes[node.name])
        dim = _normalized(_arg(node, 1, "dim", 0), rank)
        if dim == state.dim and self.shapes[node.name] != self.shapes[_first_node(node).name]:
            raise _Conflict("slices the split dimension")
        return state

    def _cat(self, node: fx.Node) -> _Shard:
        tensors = [t for t in node.args[0] if isinstance(t, fx.Node)]  # type: ignore[union-attr]
        rank = len(self.shapes[node.name])
        dim = _normalized(_arg(node, 1, "dim", 0), rank)
        state = self._broadcast(node, tensors)
        if any(t not in self.state for t in tensors) or dim == state.dim:
            raise _Conflict("concatenates along the split dimension or with a whole value")
        return state

    def _split(self, node: fx.Node, op: str) -> list[_Shard | None]:
        state = self._input(node)
        source = self.shapes[_first_node(node).name]
        dim = _normalized(_arg(node, 1 if op == "unbind" else 2, "dim", 0), len(source))
        sizes = _split_sizes(node, op, source[dim])
        if dim != state.dim:
            shift = int(op == "unbind" and dim < state.dim)
            return [_Shard(state.dim - shift, state.pieces, state.region)] * len(sizes)
        fused = len(state.pieces) == 1 and state.column and sum(sizes) == state.pieces[0]
        if op == "unbind" or not (fused or tuple(sizes) == state.pieces):
            raise _Conflict("splits the split dimension other than into its fused pieces")
        parts = self._parts_of(state)
        if fused:  # q, k and v from one projection: each shards on its own
            parts.fused[state.column] = tuple(sizes)
        if op != "chunk":
            parts.rewrites.append(ShapeRewrite(node.name, "split"))
        parts.sizes.update(sizes)
        return [_Shard(dim, (size,), state.region) for size in sizes]

    def _getitem(self, node: fx.Node) -> _Shard:
        source = self.state[node.args[0]]  # type: ignore[index]
        index = node.args[1]
        if isinstance(source, list):
            item = source[index] if isinstance(index, int) and index < len(source) else None
            if not isinstance(item, _Shard):
                raise _Conflict("uses an output of the split operation that stays whole")
            return item
        return self._indexed(source, index if isinstance(index, tuple) else (index,))

    def _indexed(self, state: _Shard, index: tuple[Any, ...]) -> _Shard:
        """x[:, :, None] and full slices: the split dimension moves with inserted axes."""
        dim, source_dim = state.dim, 0
        for item in index:
            if item is None:
                dim += source_dim <= state.dim
                continue
            split_here = source_dim == state.dim and item != slice(None)
            if item is Ellipsis or isinstance(item, fx.Node | int) or split_here:
                raise _Conflict("indexes the split value")
            source_dim += 1
        return _Shard(dim, state.pieces, state.region)

    def _attention(self, node: fx.Node, op: str) -> Any:
        """q, k and v split by heads; the mask broadcast over them. torch.export's fused
        kernels return a tuple whose first item is the output."""
        q = _first_node(node)
        operands = [a for a in (*node.args[:4], node.kwargs.get("attn_mask"))
                    if isinstance(a, fx.Node)]
        rank = len(self.shapes[q.name])
        state = self._broadcast(node, operands, rank=rank, grouped=True)
        if state.dim >= rank - 2:
            raise _Conflict("splits the sequence or head dimension, not the heads")
        return state if op == "scaled_dot_product_attention" else [state]

    # -- regions ---------------------------------------------------------------------------

    def _new_region(self) -> int:
        self.parent.append(len(self.parent))
        self.parts.append(_RegionParts())
        return len(self.parent) - 1

    def _root(self, region: int) -> int:
        while self.parent[region] != region:
            region = self.parent[region]
        return region

    def _union(self, a: int, b: int) -> None:
        a, b = self._root(a), self._root(b)
        if a != b:
            self.parent[b] = a

    def _parts(self, node: fx.Node) -> _RegionParts:
        return self.parts[self._root(_first_region(self.state[node]))]

    def _parts_of(self, state: _Shard) -> _RegionParts:
        return self.parts[self._root(state.region)]

    def _regions_of(self, state: Any) -> Iterator[int]:
        states = state if isinstance(state, list) else [state]
        return (s.region for s in states if s is not None)

    def failures(self) -> dict[str, str]:
        """Each column linear of a region with a conflict, and the conflict."""
        failed = {self._root(r): reason for r, reason in self.conflicts.items()}
        return {column: failed[self._root(region)]
                for region, parts in enumerate(self.parts) if self._root(region) in failed
                for column in parts.columns}

    def result(self, kept: Mapping[str, str]) -> Shardable:
        merged: dict[int, _RegionParts] = {}
        for region, parts in enumerate(self.parts):
            into = merged.setdefault(self._root(region), _RegionParts())
            _merge(into, parts)
        order = {n.name: i for i, n in enumerate(self.gm.graph.nodes)}
        regions = tuple(self._region(parts, order) for parts in merged.values())
        return Shardable(tuple(sorted(regions, key=lambda r: order[r.nodes[0]])),
                         self._vocabulary(), self._whole(kept))

    def _region(self, parts: _RegionParts, order: Mapping[str, int]) -> Region:
        kind = ("attention" if parts.attention else "head" if not parts.rows
                else "gated MLP" if len(parts.columns) > 1 else "MLP")
        return Region(kind, tuple(self._path(c) for c in parts.columns),
                      tuple(self._path(r) for r in parts.rows),
                      tuple(sorted(set(parts.nodes), key=order.__getitem__)),
                      tuple(parts.rewrites), tuple(sorted(parts.sizes)), tuple(parts.gathered),
                      tuple((self._path(c), sizes) for c, sizes in parts.fused.items()),
                      tuple(parts.inputs), tuple(parts.columns), tuple(parts.rows),
                      tuple(parts.row_bias))

    def _path(self, name: str) -> str:
        node = self.nodes[name]
        if node.op == "call_module":
            return str(node.target)
        weight = node.args[1]
        return str(weight.target).removesuffix(".weight") if isinstance(weight, fx.Node) \
            else name

    def _vocabulary(self) -> tuple[VocabularyEmbedding, ...]:
        """The embeddings whose rows can shard: a plain lookup (no max_norm, no scaling by
        frequency, dense) of a weight no other module shares."""
        found = []
        shared = {name for names in _parameter_names(self.gm).values() if len(names) > 1
                  for name in names}
        # A weight another node reads as well (x @ emb.weight.t()) would see a rank's rows.
        reads = collections.Counter(
            f"{n.target}.weight" if n.op == "call_module" else str(n.target)
            for n in self.gm.graph.nodes if n.op in ("call_module", "get_attr"))
        shared |= {name for name, count in reads.items() if count > 1}
        for node in self.gm.graph.nodes:
            if op_name(self.gm, node) != "embedding":
                continue
            if node.op == "call_module":
                module = self.gm.get_submodule(str(node.target))
                if module.max_norm is None and not module.scale_grad_by_freq \
                        and not module.sparse and f"{node.target}.weight" not in shared:
                    found.append(VocabularyEmbedding(str(node.target),
                                                     int(module.num_embeddings), node.name))
            elif isinstance(node.args[0], fx.Node) and node.args[0].op == "get_attr" \
                    and str(node.args[0].target).endswith(".weight") \
                    and len(node.args[0].users) == 1 \
                    and str(node.args[0].target) not in shared and not any(node.args[3:]):
                weight = _attribute(self.gm, node.args[0])
                found.append(VocabularyEmbedding(
                    str(node.args[0].target).removesuffix(".weight"), int(weight.shape[0]),
                    node.name))
            # else a weight computed in forward: not listed
        return tuple(found)

    def _whole(self, kept: Mapping[str, str]) -> tuple[WholeLinear, ...]:
        return tuple(WholeLinear(self._path(name), reason) for name, reason in kept.items())


def _merge(into: _RegionParts, parts: _RegionParts) -> None:
    into.columns += parts.columns
    into.rows += parts.rows
    into.row_bias += parts.row_bias
    into.nodes += parts.nodes
    into.rewrites += parts.rewrites
    into.sizes |= parts.sizes
    into.gathered += parts.gathered
    into.fused.update(parts.fused)
    into.inputs += [name for name in parts.inputs if name not in into.inputs]
    into.attention |= parts.attention


def _split_sizes(node: fx.Node, op: str, extent: int) -> list[int]:
    """The sizes a split, chunk or unbind of a dimension of ``extent`` cuts it into."""
    if op == "unbind":
        return [1] * extent
    how = _arg(node, 1, "split_size", None)
    for name in ("split_size_or_sections", "split_sizes", "sections", "chunks"):
        how = node.kwargs.get(name, how) if how is None else how
    if isinstance(how, list | tuple):
        return [int(size) for size in how]
    if not isinstance(how, int):
        raise _Conflict("splits by a computed size")
    size = -(-extent // how) if op == "chunk" else how  # torch.chunk: ceil(extent / chunks)
    return [min(size, extent - start) for start in range(0, extent, size)]


def _size_rewrite(node: fx.Node, dim: int, rank: int) -> ShapeRewrite:
    """The rewrite of a view's, reshape's or expand's ``dim``-th size: its arguments must list
    one size per dimension (``x.view(b, t, h, d)`` or a list), not one computed shape."""
    listed = len(node.args) == 2 and isinstance(node.args[1], list | tuple)
    sizes = node.args[1] if listed else node.args[1:]
    if len(sizes) != rank:  # type: ignore[arg-type]
        raise _Conflict("takes its shape as one computed value")
    return ShapeRewrite(node.name, dim)


def _spans(shape: tuple[int, ...], start: int, size: int) -> bool:
    """Whether some run of ``shape``'s dimensions from ``start`` multiplies to ``size``."""
    product = 1
    for extent in shape[start:]:
        product *= extent
        if product >= size:
            return product == size
    return False


def _first_region(state: Any) -> int:
    states = state if isinstance(state, list) else [state]
    return next(int(s.region) for s in states if s is not None)


def _first_node(node: fx.Node) -> fx.Node:
    first = node.args[0]
    assert isinstance(first, fx.Node)
    return first


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    return [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node)]


def _arg(node: fx.Node, position: int, name: str, default: Any = None) -> Any:
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name, default)


def _normalized(dim: Any, rank: int) -> int:
    if not isinstance(dim, int):
        raise _Conflict("takes its dimension from a computed value")
    return dim % rank


def _trained_values(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes whose value depends on a trained parameter: read as an attribute, or held by
    a module the node calls (a linear's output, a norm's)."""
    trained: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if _holds_trained(gm, node) or any(arg in trained for arg in node.all_input_nodes):
            trained.add(node)
    return trained


def _holds_trained(gm: fx.GraphModule, node: fx.Node) -> bool:
    """``node`` reads a trained parameter, or calls a module that holds one."""
    if node.op == "get_attr":
        value = operator.attrgetter(str(node.target))(gm)
        return isinstance(value, torch.nn.Parameter) and value.requires_grad
    return node.op == "call_module" and any(
        p.requires_grad for p in gm.get_submodule(str(node.target)).parameters())


def _tied_linears(gm: fx.GraphModule) -> dict[str, str]:
    """The linears whose weight another module shares (an LM head tied to the embedding),
    which stay whole: a rank's part would untie them."""
    names = _parameter_names(gm)
    tied = {}
    for node in gm.graph.nodes:
        if op_name(gm, node) != "linear":
            continue
        try:
            weight = (gm.get_submodule(str(node.target)).weight if node.op == "call_module"
                      else _attribute(gm, node.args[1]))
        except (_Conflict, AttributeError):
            continue
        sharing = names.get(id(weight), [])
        if len(sharing) > 1:
            tied[node.name] = (f"has a tied weight ({' = '.join(sharing)}): a rank's part "
                               "would untie them")
    return tied


def _parameter_names(gm: fx.GraphModule) -> dict[int, list[str]]:
    """Every name of each parameter, by identity (a tied one has several)."""
    names: dict[int, list[str]] = {}
    for name, parameter in gm.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return names


def _attribute(gm: fx.GraphModule, node: Any) -> Any:
    if not isinstance(node, fx.Node) or node.op != "get_attr":
        raise _Conflict("takes a weight that is not a model attribute")
    return operator.attrgetter(str(node.target))(gm)

