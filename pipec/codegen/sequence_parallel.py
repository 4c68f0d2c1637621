"""Sequence parallelism between a tp rank's regions (Korthikanti et al., 2022, §4.2.2).

Outside the regions a tp rank's graph (pipec.codegen.local_shards) runs whole and equal on every
rank: norms, residual adds, dropout. Under sequence parallelism each rank runs them on its 1/tp
of the sequence (dimension 1 of a (batch, sequence, features) value) instead, so they cost 1/tp
of their time and activations; Megatron-LM's collectives change to match:

- a region's *enter* all-gathers the sequence forward and reduce-scatters the gradient back
  (``sequence_enter``);
- a region's *reduce* reduce-scatters the partial sums along the sequence forward and
  all-gathers the gradient back (``sequence_reduce``): the same bytes as its all-reduce;
- a whole value that meets a split one in a node that works token by token is first cut to the
  rank's part (``scatter``: forward its slice, backward an all-gather), and a split value read by
  a node that does not work token by token (a view across the sequence, the loss, the stage's
  output) is gathered first (``sequence_gather``: forward an all-gather, backward the rank's
  slice, since what follows runs alike on every rank);
- a parameter such a node reads (a norm's weight, a row-parallel linear's bias) sees only the
  rank's tokens, so its gradient is summed over the group (``summed``: the emitted
  gradients.py all-reduces them once a step, in one buffer, not in each backward);
- a random node there (dropout) draws on the rank's own stream, since the ranks' tokens differ.

A value that crosses a stage boundary split stays split (Megatron-LM sends a rank's part too):
the stage before sends each rank's 1/tp of the sequence and the stage after receives it as such
(``split_inputs``), so the boundary carries 1/tp of the bytes and the stage's first nodes run
split at once. The model's output is gathered for the loss.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import fx, nn

from pipec.codegen.local_shards import (
    EMITTED_COLLECTIVES,
    Collectives,
    draws_random,
    own_random_around,
    parallel_graph,
    stand_in,
)
from pipec.frontend.shardable import Region, VocabularyEmbedding

__all__ = ["EMITTED_SEQUENCE", "SequenceCollectives", "SequenceParallelError",
           "SequenceParallelGraph", "sequence_parallel_graph", "sequence_split"]

SEQUENCE_DIM = 1


class SequenceParallelError(ValueError):
    """The graph cannot run sequence parallel (a split value's sequence tp does not divide)."""


@dataclass(frozen=True)
class SequenceCollectives:
    """The functions the sequence-parallel graph calls (each takes and returns one value)."""

    scatter: Callable[[Any], Any]
    gather: Callable[[Any], Any]
    enter: Callable[[Any], Any]
    reduce: Callable[[Any], Any]
    # (the rank's part, dimension or None): the whole value's shape, or its size along it.
    shape: Callable[..., Any]


# Token by token: elementwise functions and methods, and normalizations over the features.
_TOKENWISE = {"add", "sub", "mul", "truediv", "div", "neg", "pow", "rsqrt", "sqrt", "exp",
              "tanh", "gelu", "relu", "silu", "sigmoid", "dropout", "native_dropout",
              "layer_norm", "native_layer_norm", "rms_norm", "type_as", "to", "float", "half",
              "bfloat16", "contiguous", "clone", "mean", "sum", "amax", "iadd", "imul", "_to_copy",
              "alias", "softmax", "erf"}
_TOKENWISE_MODULES = (nn.LayerNorm, nn.RMSNorm, nn.Dropout, nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh,
                      nn.Sigmoid, nn.Identity)
_REDUCTIONS = {"mean", "sum", "amax", "softmax", "layer_norm", "native_layer_norm", "rms_norm"}


@dataclass(frozen=True)
class SequenceParallelGraph:
    graph_module: fx.GraphModule
    # The parameters (qualified names) that split nodes read: their gradients, each from the
    # rank's tokens only, are summed over the group every step.
    summed: tuple[str, ...]
    # Per value the graph returns, whether it leaves split (the rank's part of the sequence).
    split_outputs: tuple[bool, ...] = ()


def sequence_parallel_graph(gm: fx.GraphModule, shapes: Mapping[str, tuple[int, ...]], tp: int,
                            tensor: Collectives, sequence: SequenceCollectives,
                            split_inputs: Collection[str] = (), send_split: bool = False
                            ) -> SequenceParallelGraph:
    """``gm``, a tp rank's graph whose regions call ``tensor``'s enter and reduce, with the
    nodes between its regions split along the sequence (``shapes``: the whole values' shapes
    by node name); the placeholders ``split_inputs`` arrive split, and under ``send_split``
    (a stage before the last) split outputs leave so; SequenceParallelError where tp does not
    divide a sequence that would be split."""
    rewriter = _rewritten(gm, shapes, tp, tensor, sequence, split_inputs, send_split)
    gm.graph.lint()
    gm.recompile()
    return SequenceParallelGraph(gm, tuple(sorted(rewriter.summed)), rewriter.split_outputs)


def sequence_split(gm: fx.GraphModule, shapes: Mapping[str, tuple[int, ...]],
                   regions: Sequence[Region], embeddings: Sequence[VocabularyEmbedding],
                   tp: int) -> frozenset[str]:
    """The nodes of ``gm`` (the whole model's graph, its values' ``shapes`` by name) that a tp
    rank of ``regions`` and ``embeddings`` runs on its part of the sequence;
    SequenceParallelError where tp does not divide a sequence that would be split."""
    local = parallel_graph(gm, regions, tp, EMITTED_COLLECTIVES, embeddings)
    rewriter = _rewritten(local, shapes, tp, EMITTED_COLLECTIVES, EMITTED_SEQUENCE)
    names = {n.name for n in gm.graph.nodes}
    return frozenset(n.name for n in rewriter.split if n.name in names)


def _rewritten(gm: fx.GraphModule, shapes: Mapping[str, tuple[int, ...]], tp: int,
               tensor: Collectives, sequence: SequenceCollectives,
               split_inputs: Collection[str] = (), send_split: bool = False) -> _Rewriter:
    rewriter = _Rewriter(gm, shapes, tp, tensor, sequence, send_split)
    rewriter.split.update(n for n in gm.graph.nodes
                          if n.op == "placeholder" and n.name in split_inputs)
    for node in list(gm.graph.nodes):
        rewriter.visit(node)
    mixed = rewriter.summed & rewriter.whole_reads()
    if mixed:
        raise SequenceParallelError(
            f"{sorted(mixed)[0]} is read both on a rank's part of the sequence and whole: "
            "its gradient cannot be summed over the group")
    return rewriter


def _name(target: Any) -> str:
    name = target if isinstance(target, str) else getattr(target, "__name__", str(target))
    return name.split(".")[0]


def _shape(node: Any, shapes: Mapping[str, tuple[int, ...]]) -> tuple[int, ...] | None:
    if not isinstance(node, fx.Node):
        return None
    if node.name in shapes:
        return tuple(shapes[node.name])
    meta = node.meta.get("tensor_meta")
    if meta is not None and hasattr(meta, "shape"):
        return tuple(meta.shape)
    value = node.meta.get("val")
    return tuple(value.shape) if hasattr(value, "shape") else None


class _Rewriter:
    def __init__(self, gm: fx.GraphModule, shapes: Mapping[str, tuple[int, ...]], tp: int,
                 tensor: Collectives, sequence: SequenceCollectives,
                 send_split: bool = False) -> None:
        self.gm, self.graph, self.tp, self.known = gm, gm.graph, tp, shapes
        self.tensor, self.sequence, self.send_split = tensor, sequence, send_split
        self.split_outputs: tuple[bool, ...] = ()
        self.split: set[fx.Node] = set()  # values this rank holds 1/tp of the sequence of
        self.shapes: dict[fx.Node, tuple[int, ...] | None] = {}  # the whole shapes
        self.scattered: dict[fx.Node, fx.Node] = {}
        self.gathered: dict[fx.Node, fx.Node] = {}
        self.summed: set[str] = set()

    def shape(self, node: Any) -> tuple[int, ...] | None:
        """The whole value's shape: recorded by the trace, else its first input's."""
        if not isinstance(node, fx.Node):
            return None
        if node not in self.shapes:
            own = _shape(node, self.known) if node.op != "get_attr" else None
            first = next((a for a in node.all_input_nodes), None)
            self.shapes[node] = own if own is not None or first is None else self.shape(first)
        return self.shapes[node]

    def visit(self, node: fx.Node) -> None:
        if node.op == "output":
            self.output(node)
        elif node.target is self.tensor.enter:
            node.target = self.sequence.enter
            node.args = (self.scatter(node.args[0]),)
        elif node.target is self.tensor.reduce:
            node.target = self.sequence.reduce
            self.split.add(node)
        elif node.target in (self.tensor.own_random, self.tensor.shared_random):
            if node.args[0] in self.split:
                self.split.add(node)
        elif node.op == "call_method" and node.target == "type_as" \
                and node.args[0] not in self.split:
            return  # reads the split value's dtype only (a row-parallel bias's cast)
        elif _reads_metadata(node) and node.args[0] in self.split:
            self.whole_metadata(node)
        elif any(a in self.split for a in node.all_input_nodes):
            if self.tokenwise(node):
                self.split_node(node)
            else:
                node.args, node.kwargs = self.map_split((node.args, node.kwargs), self.gather)

    def output(self, node: fx.Node) -> None:
        """The values the graph returns: gathered, unless they leave split (``send_split``)."""
        returned = node.args[0]
        values = returned if isinstance(returned, tuple | list) else (returned,)
        self.split_outputs = tuple(self.send_split and v in self.split for v in values)
        if not self.send_split:
            node.args = (self.map_split(returned, self.gather),)

    def whole_metadata(self, node: fx.Node) -> None:
        """A read of a split value's shape or size gives the whole value's, with no
        collective; its dtype or device are the same."""
        if node.op == "call_function" and node.args[1] == "shape":
            node.target, node.args = self.sequence.shape, (node.args[0],)
        elif node.op == "call_method" and node.target == "size":
            node.op, node.target = "call_function", self.sequence.shape
            node.args, node.kwargs = (node.args[0], *node.args[1:], *node.kwargs.values()), {}

    def tokenwise(self, node: fx.Node) -> bool:
        """Whether ``node`` works token by token on its split inputs: an elementwise or
        feature-wise operation that keeps (batch, sequence), whose other inputs are whole
        values of the split ones' shape, parameters or broadcast along features."""
        if node.op == "call_module":
            if not isinstance(self.gm.get_submodule(str(node.target)), _TOKENWISE_MODULES):
                return False
        elif node.op not in ("call_function", "call_method") or \
                (_name(node.target) not in _TOKENWISE and node.target not in _OPERATORS):
            return False
        split = next(a for a in node.all_input_nodes if a in self.split)
        whole, out = self.shape(split), self.shape(node)
        if whole is None or out is None or len(whole) != 3 or len(out) < 2 \
                or out[1:2] != whole[1:2]:
            return False
        if _name(node.target) in _REDUCTIONS and not self.over_features(node, len(whole)):
            return False
        return all(self.joins(a, whole) for a in node.all_input_nodes if a not in self.split)

    def over_features(self, node: fx.Node, dims: int) -> bool:
        """A reduction's dimension is the last (features); a norm's always is."""
        if _name(node.target) in ("layer_norm", "native_layer_norm", "rms_norm"):
            return True
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
        dims_read = dim if isinstance(dim, list | tuple) else [dim]
        return all(isinstance(d, int) and d in (-1, dims - 1) for d in dims_read)

    def joins(self, value: fx.Node, whole: tuple[int, ...]) -> bool:
        """A whole input may meet split ones where it is of their shape (then cut), or made of
        parameters and constants only, without a sequence (a norm's weight, ``1 + w``: their
        gradients are summed over the group); not a value computed from the activations."""
        shape = self.shape(value)
        if shape is not None and len(shape) >= 2:
            return shape[1:] == whole[1:]
        return not self.reads_activations(value)

    def ancestry(self, value: fx.Node) -> set[fx.Node]:
        """``value`` and what it is computed from, a ``type_as``'s dtype source left out."""
        seen: set[fx.Node] = set()
        todo = [value]
        while todo:
            node = todo.pop()
            if node in seen:
                continue
            seen.add(node)
            if node.op == "call_method" and node.target == "type_as":
                todo += [a for a in node.args[:1] if isinstance(a, fx.Node)]
            elif node not in self.split:
                todo += node.all_input_nodes
        return seen

    def reads_activations(self, value: fx.Node) -> bool:
        return any(n.op in ("placeholder", "call_module") or n in self.split
                   for n in self.ancestry(value))

    def trainable(self, target: str) -> bool:
        try:
            return bool(self.gm.get_parameter(target).requires_grad)
        except AttributeError:  # a buffer or a constant: no gradient
            return False

    def split_node(self, node: fx.Node) -> None:
        """``node`` on the rank's tokens: its whole inputs cut, its parameters' gradients summed
        over the group, its random numbers the rank's own."""
        whole = self.shape(next(a for a in node.all_input_nodes if a in self.split))
        assert whole is not None

        def cut(value: Any) -> Any:
            if not isinstance(value, fx.Node) or value in self.split:
                return value
            shape = self.shape(value)
            if shape is not None and len(shape) >= 2 and shape[1:] == whole[1:]:
                return self.scatter(value)
            self.summed.update(str(n.target) for n in self.ancestry(value)
                               if n.op == "get_attr" and self.trainable(str(n.target)))
            return value

        node.args, node.kwargs = fx.node.map_arg((node.args, node.kwargs), cut)
        if node.op == "call_module":
            self.module_parameters(node)
        self.split.add(node)
        if self.tensor.own_random is not None and self.tensor.shared_random is not None \
                and draws_random(self.gm, node):
            own_random_around(self.graph, node, self.tensor.own_random,
                              self.tensor.shared_random)
            self.split.update(u for u in node.users)

    def module_parameters(self, node: fx.Node) -> None:
        """A module on the rank's tokens: its parameters' gradients summed over the group."""
        path = str(node.target)
        self.summed.update(f"{path}.{name}" for name, p in
                           self.gm.get_submodule(path).named_parameters() if p.requires_grad)

    def whole_reads(self) -> set[str]:
        """The trainable parameters that nodes running whole read (a shared module called once
        on split values and once on whole ones)."""
        reads: set[str] = set()
        for node in self.graph.nodes:
            if node.op == "call_module" and node not in self.split:
                path = str(node.target)
                reads.update(f"{path}.{name}" for name, p in
                             self.gm.get_submodule(path).named_parameters() if p.requires_grad)
            elif node.op == "get_attr" and self.trainable(str(node.target)) and any(
                    u not in self.split and self.reads_activations(u) for u in node.users):
                reads.add(str(node.target))
        return reads

    def scatter(self, value: Any) -> Any:
        """The rank's part of ``value``'s sequence (``value`` itself where already split)."""
        if not isinstance(value, fx.Node) or value in self.split:
            return value
        if value not in self.scattered:
            shape = self.shape(value)
            if shape is None or len(shape) != 3 or shape[SEQUENCE_DIM] % self.tp:
                raise SequenceParallelError(
                    f"{value.name}: a sequence of shape {shape} does not split over "
                    f"{self.tp} ranks")
            with self.graph.inserting_after(value):
                self.scattered[value] = self.graph.call_function(self.sequence.scatter,
                                                                 (value,))
            self.split.add(self.scattered[value])
            self.shapes[self.scattered[value]] = shape
        return self.scattered[value]

    def gather(self, value: fx.Node) -> fx.Node:
        if value not in self.gathered:
            with self.graph.inserting_after(value):
                self.gathered[value] = self.graph.call_function(self.sequence.gather, (value,))
            self.shapes[self.gathered[value]] = self.shape(value)
        return self.gathered[value]

    def map_split(self, value: Any, function: Callable[[fx.Node], fx.Node]) -> Any:
        return fx.node.map_arg(value, lambda a: function(a) if a in self.split else a)


def _reads_metadata(node: fx.Node) -> bool:
    """``getattr(value, "shape" | "dtype" | "device" …)`` or ``value.size(…)`` (not
    ``value.T``, a tensor: that is read across tokens, gathered)."""
    return (node.op == "call_function" and node.target is getattr
            and node.args[1] in _METADATA) or \
        (node.op == "call_method" and node.target in ("size", "dim", "get_device"))


_METADATA = {"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "layout"}


_OPERATORS = {operator.add, operator.sub, operator.mul, operator.truediv, operator.neg,
              operator.pow, operator.iadd, operator.imul}


# The functions the emitted stages call: tensor_parallel.py's.
EMITTED_SEQUENCE = SequenceCollectives(stand_in("scatter"), stand_in("sequence_gather"),
                                       stand_in("sequence_enter"), stand_in("sequence_reduce"),
                                       stand_in("whole_shape"))
