"""Measure each fx node on meta tensors: FLOPs forward and backward, and the bytes autograd
saves for backward, attributed to the node that allocated them (the annotate pass's engine)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

from pipec.errors import TraceError
from pipec.frontend.costgraph import COMPUTE_OPS, KernelCall
from pipec.frontend.inplace import written
from pipec.frontend.kernels import KernelLog
from pipec.frontend.tensors import flat_tensors

# A storage a node saves for backward: ("input", k), ("output", j) or ("internal", bytes).
Saved = tuple[str, int]

@dataclass(frozen=True)
class Measured:
    value: Any
    fwd_flops: int
    bwd_flops: int
    saved_bytes: int  # bytes autograd saves for backward that this node allocated
    saved_output: bool = False  # some node saves this value for backward
    # The operations autograd records for the node's backward (its graph's nodes), per
    # micro-batch, each host memory while the micro-batch is in flight.
    autograd_nodes: int = 0
    kernels: tuple[KernelCall, ...] = ()  # its forward's products and convolutions
    selective_bytes: int = 0  # what selective recomputation keeps of it (pipec.frontend.kernels)

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
        self.measured: dict[str, Measured] = {}
        self.static = {storage_id(t) for t in (*gm.parameters(), *gm.buffers())}
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
            self.measured[n.name] = Measured(value, 0, 0, 0)
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
        inputs = flat_tensors((args, kwargs))
        if key in self.memo and _rebuildable(self.memo[key].output):
            value = _rebuild(self.memo[key].output, inputs)
        elif key in self.memo:
            value = getattr(self, n.op)(n.target, args, kwargs)
        else:
            copies = {t.grad_fn for t in inputs if t.grad_fn is not None}  # see _isolate
            value, forward, backward, saved, kernels, kept = self._instrumented(
                n, args, kwargs, leaves)
            self.memo[key] = _Memo(forward, backward, self._recipe(inputs, value, saved),
                                   self._template(value, inputs), autograd_nodes(value, copies),
                                   kernels, kept)
        memo = self.memo[key]
        self.keep_alive += [*leaves, *inputs, *flat_tensors(value)]
        self._record(n.name, inputs, flat_tensors(value), memo.saved)
        self.measured[n.name] = Measured(value, memo.fwd_flops, memo.bwd_flops, 0,
                                         autograd_nodes=memo.autograd_nodes,
                                         kernels=memo.kernels,
                                         selective_bytes=memo.selective_bytes)
        return value

    def _instrumented(self, n: fx.Node, args: Any, kwargs: Any, leaves: list[torch.Tensor]
                      ) -> tuple[Any, int, int, list[torch.Tensor], tuple[KernelCall, ...], int]:
        """Run the node counting FLOPs forward and backward, catching what it saves and
        logging its products and convolutions (and what selective recomputation keeps: a
        fused attention's output and log-sum-exp)."""
        saved: list[torch.Tensor] = []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            saved.append(tensor)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                FlopCounterMode(display=False) as forward, KernelLog() as kernels:
            value = getattr(self, n.op)(n.target, args, kwargs)
        backward = self._backward_flops(n, value, leaves)
        kept = kernels.selective_bytes
        if n.target is F.scaled_dot_product_attention:
            value, saved = self._fused_attention(args, kwargs, value, saved)
            inputs = {storage_id(t) for t in flat_tensors((args, kwargs))}
            kept = sum(t.untyped_storage().nbytes() for t in saved
                       if storage_id(t) not in inputs)
        self.keep_alive += saved
        return (value, forward.get_total_flops(), backward, saved, tuple(kernels.calls),
                kept)

    def _signature(self, n: fx.Node, args: Any, kwargs: Any) -> Hashable:
        """What a node's costs depend on: its operation (a module's type and configuration) and
        its inputs' shapes, strides, dtypes, requires_grad and which of them share storage."""
        storages: dict[int, int] = {}

        def describe(value: Any) -> Hashable:
            if isinstance(value, torch.Tensor):
                storage = storages.setdefault(self._canonical(storage_id(value)), len(storages))
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
            input_ids = [self._canonical(storage_id(t)) for t in inputs]
            storage = self._canonical(storage_id(value))
            source = input_ids.index(storage) if storage in input_ids else None
            if source is not None and inputs[source].dtype != value.dtype:
                return _RUN  # a view in another dtype (aten.real of a complex tensor): run it
            return _TensorTemplate(tuple(value.shape), value.stride(), value.storage_offset(),
                                   value.dtype, value.requires_grad, source)
        if type(value) in (tuple, list) and flat_tensors(value):
            return type(value)(self._template(v, inputs) for v in value)
        if flat_tensors(value):
            return _RUN  # another container of tensors (a torch.return_types): run the node
        return value

    def _recipe(self, inputs: list[torch.Tensor], value: Any,
                saved: list[torch.Tensor]) -> tuple[Saved, ...]:
        """What the node saved, relative to its own inputs and outputs, so that an identical
        node elsewhere in the graph can be credited the same way."""
        input_ids = [self._canonical(storage_id(t)) for t in inputs]
        output_ids = [self._canonical(storage_id(t)) for t in flat_tensors(value)]
        recipe: dict[int, Saved] = {}
        for tensor in saved:
            storage = self._canonical(storage_id(tensor))
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
            self.saved.add(self._canonical(storage_id(tensor)))

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
        self.alias[storage_id(copy)] = self._canonical(storage_id(value))
        return copy

    def _fused_attention(self, args: Any, kwargs: Any, value: torch.Tensor,
                         math_saved: list[torch.Tensor]
                         ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The output and saved tensors of a fused attention kernel: it saves q, k, v, the
        output and the log-sum-exp, as CPU's and CUDA's flash / memory-efficient kernels do
        in training, not the T × T attention matrix of the math fallback that runs on meta
        tensors; and its output laid out as the CPU kernel lays it out (like q: a q made by
        ``view(...).transpose(1, 2)`` gives an output whose ``transpose(1, 2).reshape(...)``
        is a view, not a copy to count). CUDA's flash output is always laid out so."""
        saved: list[torch.Tensor] = []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            saved.append(tensor)
            return tensor

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                fused_output = _fused_attention(*args, **kwargs)
        except (RuntimeError, TypeError, NotImplementedError):
            # A variant the fused kernel does not take: count the math path.
            return value, math_saved
        return fused_output, saved

    def _backward_flops(self, n: fx.Node, value: Any, leaves: list[torch.Tensor]) -> int:
        params = (list(self.module.get_submodule(str(n.target)).parameters())
                  if n.op == "call_module" else [])
        wrt = leaves + [p for p in params if p.requires_grad]
        outputs = [t for t in flat_tensors(value) if t.requires_grad]
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
            storage = self._canonical(storage_id(tensor))
            if storage not in self.static and storage not in self.owner:
                self.owner[storage] = (name, int(tensor.untyped_storage().nbytes()))

    def is_saved(self, value: Any) -> bool:
        """Whether a node's tensor output (all of it) is kept for backward by some node."""
        tensors = flat_tensors(value)
        return bool(tensors) and all(self._canonical(storage_id(t)) in self.saved
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
    autograd_nodes: int = 0
    kernels: tuple[KernelCall, ...] = ()
    selective_bytes: int = 0

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
    """F.scaled_dot_product_attention's arguments, run by the fused (flash) CPU kernel, which
    takes fewer key and value heads than query heads as they are (grouped-query attention:
    ``enable_gqa``), saving them unexpanded, as CUDA's flash kernel does."""
    output, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    return output  # type: ignore[no-any-return]

def storage_id(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage()._cdata)

def measure(gm: fx.GraphModule, inputs: tuple[torch.Tensor, ...]) -> dict[str, Measured]:
    """Run with autograd on, so that each value's ``requires_grad`` is what training sees."""
    interpreter = _MeasuringInterpreter(gm)
    with torch.enable_grad():
        interpreter.run(*inputs)
    saved = interpreter.saved_bytes()
    return {name: Measured(m.value, m.fwd_flops, m.bwd_flops, saved.get(name, 0),
                            interpreter.is_saved(m.value), m.autograd_nodes, m.kernels,
                            m.selective_bytes)
            for name, m in interpreter.measured.items()}


def autograd_nodes(value: Any, below: set[Any] | None = None) -> int:
    """The backward nodes behind ``value``'s tensors, down to its leaves or to the nodes
    ``below`` (those of its inputs, not counted). AccumulateGrad nodes are left out: a
    parameter's is made once and kept, a received input's is the receive buffer's."""
    seen: set[Any] = set()
    stack = [t.grad_fn for t in flat_tensors(value)]
    while stack:
        function = stack.pop()
        if function is None or function in seen or function in (below or ()):
            continue
        seen.add(function)
        stack += [f for f, _ in function.next_functions]
    return sum(1 for f in seen if type(f).__name__ != "AccumulateGrad")

def nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return int(value.numel() * value.element_size())
    if isinstance(value, tuple | list):
        return sum(nbytes(v) for v in value)
    return 0
