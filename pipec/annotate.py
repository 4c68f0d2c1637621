"""Annotate pass: per-node shapes, FLOPs and bytes, measured on meta tensors (nothing allocated).

Every cost is linear in the micro-batch size m, ``cost(m) = fixed + per_sample · m``: the pass runs
the graph twice, at batches 2 and 4, and takes the two coefficients from the difference. This
keeps batch-independent values (position ids, masks) from being scaled with the batch. Batch 1 is
avoided: with a dimension of size 1 some ops skip a copy (a reshape of a transposed view is then
free), so batch 1 does not lie on the line.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import fx, nn
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

from pipec.autocast import autocast_dtypes
from pipec.errors import ModelFileError, TraceError
from pipec.inplace import cuts_splitting_aliases, written
from pipec.loader import ModelSpec
from pipec.trace import Traced, batch_inputs

COMPUTE_OPS = ("call_module", "call_function", "call_method")
# A storage a node saves for backward: ("input", k), ("output", j) or ("internal", bytes).
Saved = tuple[str, int]
MEASURED_BATCHES = (2, 4)

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
    bwd_flops: Linear  # counted on the node's real backward (input and weight gradients)
    output_bytes: Linear  # what the node returns (sent when a boundary follows it)
    saved_bytes: Linear  # what autograd keeps for backward, allocated by this node
    params: int  # parameters this node is the first user of
    param_bytes: int
    buffer_bytes: int
    # Parameters an earlier node used too (tied weights), counted at their last user: a stage
    # boundary between the two users gives the later stage a copy of its own.
    shared_bytes: int = 0
    # Alive while the node's backward runs: the gradient of its output and those of its inputs.
    working_bytes: Linear = Linear(0.0, 0.0)


@dataclass(frozen=True)
class LossCost:
    """``loss_fn`` on the model's output (it runs on the last stage, outside the traced graph)."""

    saved_bytes: Linear  # kept for backward besides its inputs (cross-entropy: log-softmax)
    working_bytes: Linear  # alive in its backward: gradients of the output and of saved values
    target_bytes: Linear  # the targets the last stage receives for a micro-batch


@dataclass(frozen=True)
class ValueSpec:
    """A tensor that may cross a stage boundary: what the receiving stage must allocate."""

    name: str
    shape_low: tuple[int, ...]  # at the first of MEASURED_BATCHES
    shape_high: tuple[int, ...]  # at the second
    dtype: str  # torch dtype name, e.g. "float32"
    requires_grad: bool
    # Its dtype in the whole model's run under bf16 autocast ("" given: ``dtype``): what a stage
    # boundary carries under --precision bf16 (a Linear's bf16 output, an fp32 residual stream).
    autocast_dtype: str = ""

    def __post_init__(self) -> None:
        if not self.autocast_dtype:
            object.__setattr__(self, "autocast_dtype", self.dtype)

    def shape_at(self, micro_batch: int) -> tuple[int, ...]:
        """Shapes are linear in the batch: the batch dimension grows, the others do not."""
        low, high = MEASURED_BATCHES
        return tuple(a + (b - a) * (micro_batch - low) // (high - low)
                     for a, b in zip(self.shape_low, self.shape_high, strict=True))


@dataclass(frozen=True)
class CostGraph:
    """Costs of the compute nodes in topological order, and of every possible cut.

    Cut i separates ``nodes[:i]`` from ``nodes[i:]``; cuts 0 and n are the graph's ends.
    """

    nodes: tuple[NodeCost, ...]
    cut_bytes: tuple[Linear, ...]  # bytes of the values live across each cut (n + 1 entries)
    legal_cuts: tuple[bool, ...]  # a stage boundary may sit at this cut
    values: tuple[ValueSpec, ...]  # inputs and tensor-valued nodes, in graph order
    # Of cut_bytes, the values no node saves for backward: a stage that sends them keeps them
    # anyway until their backward (torch.distributed.pipelining caches a stage's outputs).
    held_cut_bytes: tuple[Linear, ...] = ()
    loss: LossCost = LossCost(Linear(0.0, 0.0), Linear(0.0, 0.0), Linear(0.0, 0.0))
    # cut_bytes with each value in its dtype under bf16 autocast (ValueSpec.autocast_dtype).
    cut_bytes_bf16: tuple[Linear, ...] = ()

    def value(self, name: str) -> ValueSpec:
        return next(v for v in self.values if v.name == name)

    def cut_bytes_at(self, precision: str) -> tuple[Linear, ...]:
        """The bytes crossing each cut when training at ``precision`` ("fp32" or "bf16")."""
        bf16 = precision == "bf16" and self.cut_bytes_bf16
        return self.cut_bytes_bf16 if bf16 else self.cut_bytes

    @property
    def total_params(self) -> int:
        return sum(n.params for n in self.nodes)


def annotate(traced: Traced, spec: ModelSpec, autocast_device: str = "cuda") -> CostGraph:
    """Measure ``traced`` and the model file's loss on sample batches of each of
    MEASURED_BATCHES, on meta tensors; and each value's dtype under ``autocast_device``'s bf16
    autocast ("cuda" or "cpu", whose rules differ)."""
    batches = [batch_inputs(spec, size) for size in MEASURED_BATCHES]
    gm = traced.graph_module
    one, two = (_measure(gm, tuple(t.to("meta") for t in inputs)) for inputs, _ in batches)
    compute = [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]
    params, buffers = _first_users(gm, compute)
    shared = _shared_bytes(gm, compute)
    nodes = tuple(_node_cost(n, one[n.name], two[n.name], params.get(n.name, ()),
                             buffers.get(n.name, 0), shared.get(n.name, 0)) for n in compute)
    lifetimes = _lifetimes(gm, compute)
    sizes = {**{n.name: c.output_bytes for n, c in zip(compute, nodes, strict=True)},
             **_input_bytes(gm, one, two)}
    nodes = tuple(replace(c, working_bytes=_sum_linear(
        [c.output_bytes, *(sizes[a.name] for a in n.all_input_nodes if a.name in sizes)]))
        for n, c in zip(compute, nodes, strict=True))
    live = _live_sets(lifetimes, len(compute))
    held = [v for v in sizes if not one[v].saved_output]
    legal = _legal_cuts(compute, lifetimes, nodes)
    autocast = autocast_dtypes(gm, batches[0][0], autocast_device)
    values = tuple(_value_spec(n.name, one[n.name].value, two[n.name].value,
                               autocast.get(n.name, ""))
                   for n in gm.graph.nodes if n.name in lifetimes
                   and isinstance(one[n.name].value, torch.Tensor))
    outputs = [_model_output(gm, measured) for measured in (one, two)]
    return CostGraph(nodes=nodes, legal_cuts=legal, values=values,
                     cut_bytes=tuple(_sum_linear(sizes[v] for v in names) for names in live),
                     held_cut_bytes=tuple(_sum_linear(sizes[v] for v in names if v in held)
                                          for names in live),
                     loss=_loss_cost(spec, outputs, [targets for _, targets in batches]),
                     cut_bytes_bf16=_autocast_cut_bytes(values, sizes, live))


def _autocast_cut_bytes(values: Sequence[ValueSpec], sizes: dict[str, Linear],
                        live: list[list[str]]) -> tuple[Linear, ...]:
    """Each cut's bytes with its tensors in their dtypes under autocast (same shapes)."""
    ratio = {v.name: _itemsize(v.autocast_dtype) / _itemsize(v.dtype) for v in values}
    return tuple(_sum_linear(Linear(sizes[v].fixed * ratio.get(v, 1.0),
                                    sizes[v].per_sample * ratio.get(v, 1.0)) for v in names)
                 for names in live)


def _itemsize(dtype: str) -> int:
    return int(getattr(torch, dtype).itemsize)


def _model_output(gm: fx.GraphModule, measured: dict[str, _Measured]) -> Any:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    return measured[output.name].value


def _loss_cost(spec: ModelSpec, outputs: list[Any], targets: list[Any]) -> LossCost:
    """``loss_fn`` at each of MEASURED_BATCHES (saved, working and target bytes)."""
    loss_fn = getattr(spec.module, "loss_fn", F.cross_entropy)
    try:
        at = [_loss_bytes(loss_fn, output, target)
              for output, target in zip(outputs, targets, strict=True)]
    except Exception as exc:
        raise ModelFileError(f"{spec.path}: loss_fn(output, targets) failed on the model's "
                             f"output: {type(exc).__name__}: {exc}") from None
    saved, working, target_bytes = zip(*at, strict=True)
    return LossCost(_linear(*saved), _linear(*working), _linear(*target_bytes))


def _loss_bytes(loss_fn: Any, output: Any, target: Any) -> tuple[int, int, int]:
    """Run ``loss_fn`` on meta copies of the model's output (autograd leaves, as the last
    stage's output is to the loss) and catch what it saves besides its inputs. Its backward
    makes a gradient for the output and one for each saved value."""
    output = fx.node.map_aggregate(output, _meta_leaf)
    target = fx.node.map_aggregate(
        target, lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t)
    kept: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        kept.append(tensor)
        return tensor

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn(output, target)
    inputs = {_storage_id(t) for t in _tensors((output, target))}
    own = {_storage_id(t): int(t.untyped_storage().nbytes()) for t in kept
           if _storage_id(t) not in inputs}
    saved = sum(own.values())
    return saved, saved + _nbytes(output), _nbytes(target)


def _meta_leaf(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return torch.empty_like(value, device="meta").requires_grad_()
    return value


def _value_spec(name: str, one: torch.Tensor, two: torch.Tensor,
                autocast_dtype: str) -> ValueSpec:
    dtype = str(one.dtype).removeprefix("torch.")
    return ValueSpec(name, tuple(one.shape), tuple(two.shape), dtype, bool(one.requires_grad),
                     autocast_dtype)


@dataclass(frozen=True)
class _Measured:
    value: Any
    fwd_flops: int
    bwd_flops: int
    saved_bytes: int  # bytes autograd saves for backward that this node allocated
    saved_output: bool = False  # some node saves this value for backward


class _MeasuringInterpreter(fx.Interpreter):
    """Runs the graph on meta tensors, each compute node in isolation (cf. fx's ShapeProp).

    A node runs on detached copies of its inputs under ``FlopCounterMode`` and
    ``saved_tensors_hooks``, then its backward runs for real: forward and backward FLOPs and the
    tensors autograd saves are measured, not assumed. Storages are tracked by identity, so a
    tensor saved by several nodes, or aliased by views and in-place ops, counts once, with the
    node that allocated it; parameters and buffers are static memory and are not counted.
    """

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.measured: dict[str, _Measured] = {}
        self.static = {_storage_id(t) for t in (*gm.parameters(), *gm.buffers())}
        self.alias: dict[int, int] = {}  # an input copy's storage -> the storage it stands for
        self.owner: dict[int, tuple[str, int]] = {}  # storage -> (allocating node, bytes)
        self.saved: set[int] = set()
        # Storages are keyed by address: keep every tensor seen alive for the whole run, or a
        # freed storage's address could be reused by another.
        self.keep_alive: list[torch.Tensor] = []
        self.memo: dict[Hashable, _Memo] = {}
        self.internal: dict[str, int] = {}  # bytes saved that no other node can see

    def run_node(self, n: fx.Node) -> Any:
        if n.op not in COMPUTE_OPS:
            value = super().run_node(n)
            self.measured[n.name] = _Measured(value, 0, 0, 0)
            return value
        try:
            value = self._measure_node(n)
        except Exception as exc:
            raise TraceError(f"running {n.format_node()} on meta tensors failed: "
                             f"{type(exc).__name__}: {exc}") from None
        self._pass_on_grad(n, value)
        return value

    def _pass_on_grad(self, n: fx.Node, value: Any) -> None:
        """A node runs on copies of its inputs, so an in-place op that mixes in a value needing
        a gradient (``x.add_(h)``, x the data) leaves x as it was: make x require grad for the
        nodes after it, as autograd would."""
        target = written(self.module, n)
        current = self.env.get(target) if target is not None else None
        if (isinstance(value, torch.Tensor) and value.requires_grad
                and isinstance(current, torch.Tensor) and not current.requires_grad):
            self.env[target] = current.detach().requires_grad_()

    def _measure_node(self, n: fx.Node) -> Any:
        """Measure a node, or reuse the measurement of an identical one (a repeated layer)."""
        leaves: list[torch.Tensor] = []
        args, kwargs = fx.node.map_aggregate(self.fetch_args_kwargs_from_env(n),
                                             lambda v: self._isolate(v, leaves))
        key = self._signature(n, args, kwargs)
        inputs = _tensors((args, kwargs))
        if key in self.memo and _rebuildable(self.memo[key].output):
            value = _rebuild(self.memo[key].output, inputs)
        elif key in self.memo:
            value = getattr(self, n.op)(n.target, args, kwargs)
        else:
            value, forward, backward, saved = self._instrumented(n, args, kwargs, leaves)
            self.memo[key] = _Memo(forward, backward, self._recipe(inputs, value, saved),
                                   self._template(value, inputs))
        forward, backward, recipe = (self.memo[key].fwd_flops, self.memo[key].bwd_flops,
                                     self.memo[key].saved)
        self.keep_alive += [*leaves, *inputs, *_tensors(value)]
        self._record(n.name, inputs, _tensors(value), recipe)
        self.measured[n.name] = _Measured(value, forward, backward, 0)
        return value

    def _instrumented(self, n: fx.Node, args: Any, kwargs: Any, leaves: list[torch.Tensor]
                      ) -> tuple[Any, int, int, list[torch.Tensor]]:
        """Run the node counting FLOPs forward and backward and catching what it saves."""
        saved: list[torch.Tensor] = []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            saved.append(tensor)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                FlopCounterMode(display=False) as forward:
            value = getattr(self, n.op)(n.target, args, kwargs)
        if n.target is F.scaled_dot_product_attention:
            saved = self._fused_attention_saved(args, kwargs, value, saved)
        self.keep_alive += saved
        return value, forward.get_total_flops(), self._backward_flops(n, value, leaves), saved

    def _signature(self, n: fx.Node, args: Any, kwargs: Any) -> Hashable:
        """What a node's costs depend on: its operation (a module's type and configuration) and
        its inputs' shapes, strides, dtypes, requires_grad and which of them share storage."""
        storages: dict[int, int] = {}

        def describe(value: Any) -> Hashable:
            if isinstance(value, torch.Tensor):
                storage = storages.setdefault(self._canonical(_storage_id(value)), len(storages))
                return (tuple(value.shape), value.stride(), value.storage_offset(), value.dtype,
                        value.requires_grad, storage)
            if isinstance(value, tuple | list):
                return (type(value).__name__, *map(describe, value))
            if isinstance(value, dict):
                return tuple((k, describe(v)) for k, v in value.items())
            return repr(value)

        operation: Hashable = n.target
        if n.op == "call_module":
            module = self.module.get_submodule(str(n.target))
            operation = (type(module), module.extra_repr(), module.training,
                         tuple((p.shape, p.requires_grad) for p in module.parameters()))
        return n.op, operation, describe(args), describe(kwargs)

    def _template(self, value: Any, inputs: list[torch.Tensor]) -> Any:
        """How to make the node's output again without running it: new storages and views of
        its inputs, with their layouts; values with no tensor in them as they are."""
        if isinstance(value, torch.Tensor):
            input_ids = [self._canonical(_storage_id(t)) for t in inputs]
            storage = self._canonical(_storage_id(value))
            source = input_ids.index(storage) if storage in input_ids else None
            return _TensorTemplate(tuple(value.shape), value.stride(), value.storage_offset(),
                                   value.dtype, value.requires_grad, source)
        if type(value) in (tuple, list) and _tensors(value):
            return type(value)(self._template(v, inputs) for v in value)
        if _tensors(value):
            return _RUN  # another container of tensors (a torch.return_types): run the node
        return value

    def _recipe(self, inputs: list[torch.Tensor], value: Any,
                saved: list[torch.Tensor]) -> tuple[Saved, ...]:
        """What the node saved, relative to its own inputs and outputs, so that an identical
        node elsewhere in the graph can be credited the same way."""
        input_ids = [self._canonical(_storage_id(t)) for t in inputs]
        output_ids = [self._canonical(_storage_id(t)) for t in _tensors(value)]
        recipe: dict[int, Saved] = {}
        for tensor in saved:
            storage = self._canonical(_storage_id(tensor))
            if storage in self.static or storage in recipe:
                continue
            if storage in input_ids:
                recipe[storage] = ("input", input_ids.index(storage))
            elif storage in output_ids:
                recipe[storage] = ("output", output_ids.index(storage))
            else:
                recipe[storage] = ("internal", int(tensor.untyped_storage().nbytes()))
        return tuple(recipe.values())

    def _record(self, name: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor],
                recipe: tuple[Saved, ...]) -> None:
        """Credit the saved storages: inputs to whoever allocated them, outputs to this node."""
        self._own(name, outputs)
        for kind, index in recipe:
            if kind == "internal":
                self.internal[name] = self.internal.get(name, 0) + index
                continue
            tensor = (inputs if kind == "input" else outputs)[index]
            self._own(name, [tensor])  # a model input is credited to its first saver
            self.saved.add(self._canonical(_storage_id(tensor)))

    def _isolate(self, value: Any, leaves: list[torch.Tensor]) -> Any:
        """A fresh autograd leaf for an input that needs a gradient, else a detached alias."""
        if not isinstance(value, torch.Tensor):
            return value
        if not value.requires_grad:
            return value.detach()
        leaf = value.detach().requires_grad_()
        leaves.append(leaf)
        # A non-leaf copy, so that in-place ops (ReLU(inplace=True)) are allowed; its storage
        # stands for the input's.
        copy = leaf.clone()
        self.alias[_storage_id(copy)] = self._canonical(_storage_id(value))
        return copy

    def _fused_attention_saved(self, args: Any, kwargs: Any, value: torch.Tensor,
                               math_saved: list[torch.Tensor]) -> list[torch.Tensor]:
        """What a fused attention kernel saves for backward: q, k, v, the output and the
        log-sum-exp, as CPU's and CUDA's flash / memory-efficient kernels do in training, not
        the T × T attention matrix of the math fallback that runs on meta tensors.
        """
        saved: list[torch.Tensor] = []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            saved.append(tensor)
            return tensor

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                fused_output = _fused_attention(*args, **kwargs)
        except (RuntimeError, TypeError, NotImplementedError):
            return math_saved  # a variant the fused kernel does not take: count the math path
        self.alias[_storage_id(fused_output)] = _storage_id(value)
        return saved

    def _backward_flops(self, n: fx.Node, value: Any, leaves: list[torch.Tensor]) -> int:
        params = (list(self.module.get_submodule(str(n.target)).parameters())
                  if n.op == "call_module" else [])
        wrt = leaves + [p for p in params if p.requires_grad]
        outputs = [t for t in _tensors(value) if t.requires_grad]
        if not (outputs and wrt):
            return 0
        with FlopCounterMode(display=False) as counter:
            torch.autograd.grad(outputs, wrt, [torch.ones_like(t) for t in outputs],
                                allow_unused=True)
        return int(counter.get_total_flops())

    def _canonical(self, storage: int) -> int:
        while storage in self.alias:
            storage = self.alias[storage]
        return storage

    def _own(self, name: str, tensors: list[torch.Tensor]) -> None:
        """Record ``name`` as the allocator of the storages it is the first to produce."""
        for tensor in tensors:
            storage = self._canonical(_storage_id(tensor))
            if storage not in self.static and storage not in self.owner:
                self.owner[storage] = (name, int(tensor.untyped_storage().nbytes()))

    def is_saved(self, value: Any) -> bool:
        """Whether a node's tensor output (all of it) is kept for backward by some node."""
        tensors = _tensors(value)
        return bool(tensors) and all(self._canonical(_storage_id(t)) in self.saved
                                     for t in tensors)

    def saved_bytes(self) -> dict[str, int]:
        """Bytes saved for backward, by the node that allocated them."""
        totals = dict(self.internal)
        for storage in self.saved:
            name, size = self.owner[storage]
            totals[name] = totals.get(name, 0) + size
        return totals


@dataclass(frozen=True)
class _TensorTemplate:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    requires_grad: bool
    source: int | None  # the input whose storage it views, or None for a new storage


_RUN = object()  # a template that cannot be rebuilt: the node is run again


@dataclass(frozen=True)
class _Memo:
    """A node's measurement, reusable by any node with the same signature."""

    fwd_flops: int
    bwd_flops: int
    saved: tuple[Saved, ...]
    output: Any  # a template of the output (see _template)


def _rebuildable(template: Any) -> bool:
    if template is _RUN:
        return False
    return all(map(_rebuildable, template)) if type(template) in (tuple, list) else True


def _rebuild(template: Any, inputs: list[torch.Tensor]) -> Any:
    if isinstance(template, _TensorTemplate):
        if template.source is None:
            tensor = torch.empty_strided(template.shape, template.stride, dtype=template.dtype,
                                         device="meta")
        else:
            tensor = inputs[template.source].detach().as_strided(
                template.shape, template.stride, template.offset)
        return tensor.requires_grad_(template.requires_grad)
    if type(template) in (tuple, list):
        return type(template)(_rebuild(t, inputs) for t in template)
    return template


def _fused_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                     is_causal: bool = False, scale: float | None = None,
                     enable_gqa: bool = False) -> torch.Tensor:
    """F.scaled_dot_product_attention's arguments, run by the fused (flash) CPU kernel."""
    if enable_gqa:
        raise NotImplementedError("grouped-query attention")
    output, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    return output  # type: ignore[no-any-return]


def _storage_id(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage()._cdata)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _measure(gm: fx.GraphModule, inputs: tuple[torch.Tensor, ...]) -> dict[str, _Measured]:
    """Run with autograd on, so that each value's ``requires_grad`` is what training sees."""
    interpreter = _MeasuringInterpreter(gm)
    with torch.enable_grad():
        interpreter.run(*inputs)
    saved = interpreter.saved_bytes()
    return {name: _Measured(m.value, m.fwd_flops, m.bwd_flops, saved.get(name, 0),
                            interpreter.is_saved(m.value))
            for name, m in interpreter.measured.items()}


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return int(value.numel() * value.element_size())
    if isinstance(value, tuple | list):
        return sum(_nbytes(v) for v in value)
    return 0


def _linear(at_low: float, at_high: float) -> Linear:
    """The line through the values measured at the two MEASURED_BATCHES."""
    low, high = MEASURED_BATCHES
    per_sample = (at_high - at_low) / (high - low)
    return Linear(fixed=at_low - per_sample * low, per_sample=per_sample)


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
    if not stack:
        return ""
    # {key: (qualified name, type)}; torch.export's keys are not the names ("L__self__gpt").
    key = next(reversed(stack))
    value = stack[key]
    if str(key).startswith("_empty_nn_module_stack"):  # torch.export: a node outside modules
        return ""
    return str(value[0]) if isinstance(value, tuple) and value else str(key)


def _node_cost(n: fx.Node, one: _Measured, two: _Measured,
               params: Sequence[torch.Tensor], buffer_bytes: int, shared_bytes: int) -> NodeCost:
    is_tensor = isinstance(one.value, torch.Tensor)
    return NodeCost(
        name=n.name, op=n.op, target=_target_name(n), module=_owner(n),
        shape=_shape_at_one(one.value, two.value) if is_tensor else (), is_tensor=is_tensor,
        fwd_flops=_linear(one.fwd_flops, two.fwd_flops),
        bwd_flops=_linear(one.bwd_flops, two.bwd_flops),
        output_bytes=_linear(_nbytes(one.value), _nbytes(two.value)),
        saved_bytes=_linear(one.saved_bytes, two.saved_bytes),
        params=sum(p.numel() for p in params),
        param_bytes=sum(_nbytes(p) for p in params),
        buffer_bytes=buffer_bytes, shared_bytes=shared_bytes,
    )


def _shape_at_one(low: torch.Tensor, high: torch.Tensor) -> tuple[int, ...]:
    return ValueSpec("", tuple(low.shape), tuple(high.shape), "", False).shape_at(1)


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


def _legal_cuts(compute: list[fx.Node], lifetimes: dict[str, tuple[int, int]],
                nodes: tuple[NodeCost, ...]) -> tuple[bool, ...]:
    """A cut is legal when only tensors cross it, and no two that share a storage a later node
    overwrites in place (sent, they arrive as two tensors and the write would reach one). (A
    parameter used on both sides is copied into both stages, whose gradients the training
    script sums.)"""
    n = len(compute)
    legal = [True] * (n + 1)
    is_tensor = {c.name: c.is_tensor for c in nodes}
    for name, (made, last_use) in lifetimes.items():
        if made >= 0 and not is_tensor[name]:
            for cut in range(made + 1, last_use + 1):
                legal[cut] = False
    if compute:
        gm = compute[0].graph.owning_module
        for cut in cuts_splitting_aliases(gm, compute, _live_sets(lifetimes, n)):
            legal[cut] = False
    legal[0] = legal[n] = True
    return tuple(legal)


def _shared_bytes(gm: fx.GraphModule, compute: list[fx.Node]) -> dict[str, int]:
    """Per node, the bytes of the parameters whose last user it is, among those that an earlier
    node used first (shared modules, tied weights)."""
    users: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for n, reader in _readers(gm, compute):
        for p in _tensors_of(gm, reader)[0]:
            if n.name not in users.setdefault(id(p), []):
                users[id(p)].append(n.name)
            tensors[id(p)] = p
    shared: dict[str, int] = {}
    for key, names in users.items():
        if len(names) > 1:
            shared[names[-1]] = shared.get(names[-1], 0) + _nbytes(tensors[key])
    return shared
