"""Annotate pass: per-node shapes, FLOPs and bytes, measured on meta tensors (nothing allocated).

Every cost is linear in the micro-batch size m, ``cost(m) = fixed + per_sample · m``: the pass runs
the graph twice, at batch 1 and batch 2, and takes the two coefficients from the difference. This
keeps batch-independent values (position ids, masks) from being scaled with the batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils.flop_counter import FlopCounterMode

from pipec.errors import TraceError
from pipec.trace import Traced

COMPUTE_OPS = ("call_module", "call_function", "call_method")

# Backward FLOPs of a node: twice its forward (a grad for the input and one for the weights).
# The cost-model issue replaces this with a counted backward pass.
BACKWARD_FLOPS_RATIO = 2.0


@dataclass(frozen=True)
class Linear:
    """A quantity that is ``fixed + per_sample · m`` at micro-batch size m."""

    fixed: float
    per_sample: float

    def at(self, micro_batch: int) -> float:
        return self.fixed + self.per_sample * micro_batch


@dataclass(frozen=True)
class NodeCost:
    """What one compute node of the graph costs (one micro-batch of size m)."""

    name: str
    op: str
    target: str
    module: str  # qualified name of the innermost module the node belongs to ("" for the root)
    shape: tuple[int, ...]  # output shape at batch 1 (empty when the output is not a tensor)
    is_tensor: bool
    fwd_flops: Linear
    bwd_flops: Linear
    output_bytes: Linear
    params: int  # parameters this node is the first user of
    param_bytes: int
    buffer_bytes: int


@dataclass(frozen=True)
class ValueSpec:
    """A tensor that may cross a stage boundary: what the receiving stage must allocate."""

    name: str
    shape_one: tuple[int, ...]  # at batch 1
    shape_two: tuple[int, ...]  # at batch 2
    dtype: str  # torch dtype name, e.g. "float32"
    requires_grad: bool

    def shape_at(self, micro_batch: int) -> tuple[int, ...]:
        """Shapes are linear in the batch: the batch dimension grows, the others do not."""
        return tuple(a + (b - a) * (micro_batch - 1)
                     for a, b in zip(self.shape_one, self.shape_two, strict=True))


@dataclass(frozen=True)
class CostGraph:
    """Costs of the compute nodes in topological order, and of every possible cut.

    Cut i separates ``nodes[:i]`` from ``nodes[i:]``; cuts 0 and n are the graph's ends.
    """

    nodes: tuple[NodeCost, ...]
    cut_bytes: tuple[Linear, ...]  # bytes of the values live across each cut (n + 1 entries)
    legal_cuts: tuple[bool, ...]  # a stage boundary may sit at this cut
    values: tuple[ValueSpec, ...]  # inputs and tensor-valued nodes, in graph order

    def value(self, name: str) -> ValueSpec:
        return next(v for v in self.values if v.name == name)

    @property
    def total_params(self) -> int:
        return sum(n.params for n in self.nodes)


def annotate(traced: Traced, inputs_at: Sequence[tuple[torch.Tensor, ...]]) -> CostGraph:
    """Measure ``traced`` at batch sizes 1 and 2 (``inputs_at[0]``, ``inputs_at[1]``)."""
    gm = traced.graph_module
    one, two = (_measure(gm, tuple(t.to("meta") for t in inputs)) for inputs in inputs_at)
    compute = [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]
    params, buffers = _first_users(gm, compute)
    nodes = tuple(_node_cost(n, one[n.name], two[n.name], params.get(n.name, ()),
                             buffers.get(n.name, 0)) for n in compute)
    lifetimes = _lifetimes(gm, compute)
    sizes = {**{n.name: c.output_bytes for n, c in zip(compute, nodes, strict=True)},
             **_input_bytes(gm, one, two)}
    cut_bytes = tuple(_sum_linear(sizes[v] for v in live) for live in _live_sets(lifetimes,
                                                                                   len(compute)))
    legal = _legal_cuts(gm, compute, lifetimes, params, nodes)
    values = tuple(_value_spec(n.name, one[n.name].value, two[n.name].value)
                   for n in gm.graph.nodes if n.name in lifetimes
                   and isinstance(one[n.name].value, torch.Tensor))
    return CostGraph(nodes=nodes, cut_bytes=cut_bytes, legal_cuts=legal, values=values)


def _value_spec(name: str, one: torch.Tensor, two: torch.Tensor) -> ValueSpec:
    dtype = str(one.dtype).removeprefix("torch.")
    return ValueSpec(name, tuple(one.shape), tuple(two.shape), dtype, bool(one.requires_grad))


@dataclass(frozen=True)
class _Measured:
    value: Any
    flops: int


class _MeasuringInterpreter(fx.Interpreter):
    """Runs the graph on meta tensors, counting each node's FLOPs (cf. fx's ShapeProp)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.measured: dict[str, _Measured] = {}

    def run_node(self, n: fx.Node) -> Any:
        counter = FlopCounterMode(display=False)
        try:
            with counter:
                value = super().run_node(n)
        except Exception as exc:
            raise TraceError(f"running {n.format_node()} on meta tensors failed: "
                             f"{type(exc).__name__}: {exc}") from None
        self.measured[n.name] = _Measured(value, counter.get_total_flops())
        return value


def _measure(gm: fx.GraphModule, inputs: tuple[torch.Tensor, ...]) -> dict[str, _Measured]:
    """Run with autograd on, so that each value's ``requires_grad`` is what training sees."""
    interpreter = _MeasuringInterpreter(gm)
    with torch.enable_grad():
        interpreter.run(*inputs)
    return interpreter.measured


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return int(value.numel() * value.element_size())
    if isinstance(value, tuple | list):
        return sum(_nbytes(v) for v in value)
    return 0


def _linear(at_one: float, at_two: float) -> Linear:
    """The line through (1, at_one) and (2, at_two)."""
    return Linear(fixed=2 * at_one - at_two, per_sample=at_two - at_one)


def _sum_linear(items: Iterator[Linear] | Sequence[Linear]) -> Linear:
    fixed = per_sample = 0.0
    for item in items:
        fixed += item.fixed
        per_sample += item.per_sample
    return Linear(fixed, per_sample)


def _owner(n: fx.Node) -> str:
    if n.op == "call_module":
        return str(n.target)
    stack = n.meta.get("nn_module_stack")
    return str(next(reversed(stack))) if stack else ""


def _node_cost(n: fx.Node, one: _Measured, two: _Measured,
               params: Sequence[torch.Tensor], buffer_bytes: int) -> NodeCost:
    fwd = _linear(one.flops, two.flops)
    is_tensor = isinstance(one.value, torch.Tensor)
    return NodeCost(
        name=n.name, op=n.op, target=_target_name(n), module=_owner(n),
        shape=tuple(one.value.shape) if is_tensor else (), is_tensor=is_tensor,
        fwd_flops=fwd,
        bwd_flops=Linear(fwd.fixed * BACKWARD_FLOPS_RATIO, fwd.per_sample * BACKWARD_FLOPS_RATIO),
        output_bytes=_linear(_nbytes(one.value), _nbytes(two.value)),
        params=sum(p.numel() for p in params),
        param_bytes=sum(_nbytes(p) for p in params),
        buffer_bytes=buffer_bytes,
    )


def _target_name(n: fx.Node) -> str:
    target = n.target
    return target if isinstance(target, str) else getattr(target, "__name__", repr(target))


def _tensors_of(gm: fx.GraphModule, n: fx.Node) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(parameters, buffers) that node ``n`` reads directly."""
    if n.op == "call_module":
        module = gm.get_submodule(str(n.target))
        return list(module.parameters()), list(module.buffers())
    if n.op == "get_attr":
        value = _get_attr(gm, str(n.target))
        if isinstance(value, nn.Parameter):
            return [value], []
        if isinstance(value, nn.Module):
            return list(value.parameters()), list(value.buffers())
        return [], [value] if isinstance(value, torch.Tensor) else []
    return [], []


def _get_attr(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _users_of_attr(n: fx.Node) -> list[fx.Node]:
    """Compute nodes that read the value of a get_attr node (through its users)."""
    return [u for u in n.users if u.op in COMPUTE_OPS]


def _first_users(gm: fx.GraphModule, compute: list[fx.Node]
                 ) -> tuple[dict[str, tuple[torch.Tensor, ...]], dict[str, int]]:
    """Attribute each parameter and buffer to the first compute node that uses it."""
    seen: set[int] = set()
    params: dict[str, tuple[torch.Tensor, ...]] = {}
    buffers: dict[str, int] = {}
    for n, reader in _readers(gm, compute):
        p_list, b_list = _tensors_of(gm, reader)
        new_params = tuple(p for p in p_list if id(p) not in seen)
        new_buffers = [b for b in b_list if id(b) not in seen]
        seen.update(id(t) for t in (*new_params, *new_buffers))
        params[n.name] = params.get(n.name, ()) + new_params
        buffers[n.name] = buffers.get(n.name, 0) + sum(_nbytes(b) for b in new_buffers)
    return params, buffers


def _readers(gm: fx.GraphModule, compute: list[fx.Node]) -> Iterator[tuple[fx.Node, fx.Node]]:
    """(compute node, node whose parameters it reads): itself, or a get_attr it consumes."""
    for n in compute:
        yield n, n
        for arg in n.all_input_nodes:
            if arg.op == "get_attr":
                yield n, arg


def _lifetimes(gm: fx.GraphModule, compute: list[fx.Node]) -> dict[str, tuple[int, int]]:
    """For every value that can cross a cut: (position it is made at, last position it is used).

    Inputs are made at position -1; the output node sits at position n. get_attr values are
    excluded: each stage reads attributes itself.
    """
    position = {n.name: i for i, n in enumerate(compute)}
    last = len(compute)
    lifetimes: dict[str, tuple[int, int]] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder" or n.op in COMPUTE_OPS:
            made = position.get(n.name, -1)
            uses = [position.get(u.name, last) for u in n.users]
            lifetimes[n.name] = (made, max(uses, default=made))
    return lifetimes


def live_values(gm: fx.GraphModule) -> list[list[str]]:
    """Names of the values live across each cut, in graph order (the split pass's inputs)."""
    compute = [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]
    return _live_sets(_lifetimes(gm, compute), len(compute))


def _live_sets(lifetimes: dict[str, tuple[int, int]], n: int) -> list[list[str]]:
    """The values live across each cut i: made before position i, used at or after it."""
    live: list[list[str]] = [[] for _ in range(n + 1)]
    for name, (made, last_use) in lifetimes.items():
        for cut in range(made + 1, last_use + 1):
            live[cut].append(name)
    return live


def _input_bytes(gm: fx.GraphModule, one: dict[str, _Measured],
                 two: dict[str, _Measured]) -> dict[str, Linear]:
    return {n.name: _linear(_nbytes(one[n.name].value), _nbytes(two[n.name].value))
            for n in gm.graph.nodes if n.op == "placeholder"}


def _legal_cuts(gm: fx.GraphModule, compute: list[fx.Node], lifetimes: dict[str, tuple[int, int]],
                params: dict[str, tuple[torch.Tensor, ...]], nodes: tuple[NodeCost, ...]
                ) -> tuple[bool, ...]:
    """A cut is legal when only tensors cross it and no parameter is used on both sides."""
    n = len(compute)
    legal = [True] * (n + 1)
    is_tensor = {c.name: c.is_tensor for c in nodes}
    for name, (made, last_use) in lifetimes.items():
        if made >= 0 and not is_tensor[name]:
            for cut in range(made + 1, last_use + 1):
                legal[cut] = False
    for first, last in _param_spans(gm, compute):
        for cut in range(first + 1, last + 1):
            legal[cut] = False
    legal[0] = legal[n] = True
    return tuple(legal)


def _param_spans(gm: fx.GraphModule, compute: list[fx.Node]) -> list[tuple[int, int]]:
    """(first, last) position of the compute nodes that use each parameter (shared weights)."""
    position = {n.name: i for i, n in enumerate(compute)}
    spans: dict[int, tuple[int, int]] = {}
    for n, reader in _readers(gm, compute):
        for p in _tensors_of(gm, reader)[0]:
            i = position[n.name]
            first, last = spans.get(id(p), (i, i))
            spans[id(p)] = (min(first, i), max(last, i))
    return [span for span in spans.values() if span[0] != span[1]]
