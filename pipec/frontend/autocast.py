"""What bf16 autocast changes in the traced graph, found without running it: each value's dtype,
and the bytes each node saves for backward.

The training script runs every stage under ``torch.autocast(dtype=torch.bfloat16)``: a Linear
returns bf16, but the sum ``x + f(x)`` of an fp32 residual stream and a bf16 branch is fp32 again,
and on CUDA ``layer_norm`` and ``softmax`` return fp32. A stage boundary must carry the dtype the
single-device autocast run has there, or an fp32 value is rounded to bf16 at the cuts only and
the numerics depend on the partition. What autograd saves changes unevenly too: a Linear saves
the bf16 copy of its fp32 input (besides the fp32 value another node may save), a LayerNorm its
fp32 input, cross-entropy an fp32 log-softmax; halving the fp32 bytes undercounts all of these.
So the graph (and ``loss_fn`` on its output) runs on fake tensors (shapes and dtypes, no data) of
the target device type under that device type's autocast rules, which differ between CPU and
CUDA: once without autograd for the dtypes, and with autograd at each measured batch to count
what each node saves (each storage once, with the node that made it; the graph's inputs are the
data's, not activations).
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from pipec.frontend.costgraph import COMPUTE_OPS
from pipec.frontend.tensors import flat_tensors
from pipec.torchcompat import FakeTensorMode

log = logging.getLogger(__name__)

AUTOCAST_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class AutocastRun:
    """The graph under bf16 autocast on one device type, run at one or more batch sizes."""

    dtypes: dict[str, str] = field(default_factory=dict)  # tensor value -> dtype name
    # Per batch size: compute node -> bytes it saves for backward (each saved storage counted
    # once, with the node that made it; the graph's inputs, weights and autocast's copies of
    # weights are not activations). Empty: the graph could not run on fake tensors.
    saved: tuple[dict[str, int], ...] = ()
    loss_saved: tuple[int, ...] = ()  # per batch size: what loss_fn saves beyond its inputs


def run_under_autocast(gm: fx.GraphModule, batches: Sequence[tuple[Sequence[torch.Tensor], Any]],
                       device_type: str, loss_fn: Callable[..., Any] | None = None
                       ) -> AutocastRun:
    """The graph (and ``loss_fn`` on its output) under bf16 autocast on ``device_type`` ("cuda"
    or "cpu"), at each of ``batches`` (inputs, targets). What fake tensors cannot run is left
    out, with a warning: no dtypes (stage boundaries keep the fp32 dtypes), no saved bytes
    (bf16 memory is planned at fp32 sizes), no loss (its fp32 bytes are used)."""
    dtypes = autocast_dtypes(gm, batches[0][0], device_type)
    # Autograd on fake CUDA tensors needs a PyTorch built with CUDA (it aborts the process
    # otherwise): without one, the saved bytes are counted under CPU autocast's rules, which
    # differ from CUDA's in the few ops CUDA runs in fp32 (layer_norm, softmax).
    counted_on = device_type if device_type == "cpu" or torch.cuda.is_available() else "cpu"
    if counted_on != device_type:
        log.info("bf16 saved bytes counted under CPU autocast's rules (this PyTorch has no "
                 "CUDA); CUDA runs layer_norm and softmax in fp32")
    try:
        runs = [_fake_run(gm, inputs, counted_on, True, loss_fn, targets)
                for inputs, targets in batches]
    except Exception as exc:  # a model that fake tensors cannot run still compiles
        log.warning("could not count what the graph saves under %s bf16 autocast on fake "
                    "tensors (%s: %s); under --precision bf16 its memory is planned at fp32 "
                    "sizes", device_type, type(exc).__name__, exc)
        return AutocastRun(dtypes)
    failed = next((r.loss_error for r in runs if r.loss_error is not None), None)
    if failed is not None:
        log.warning("loss_fn could not run on fake tensors under bf16 autocast (%s: %s); its "
                    "fp32 bytes are planned", type(failed).__name__, failed)
    loss_saved = () if failed is not None or loss_fn is None else tuple(
        r.loss_saved for r in runs)
    return AutocastRun(dtypes, tuple(dict(r.saved) for r in runs), loss_saved)


def autocast_dtypes(gm: fx.GraphModule, inputs: Sequence[torch.Tensor],
                    device_type: str) -> dict[str, str]:
    """Each tensor value's dtype name under bf16 autocast on ``device_type``, by node name."""
    try:
        return _fake_run(gm, inputs, device_type, grad=False).dtypes
    except Exception as exc:  # a model that fake tensors cannot run still compiles
        log.warning("could not find the dtypes under %s bf16 autocast (%s: %s); stage "
                    "boundaries keep each value's fp32 dtype", device_type,
                    type(exc).__name__, exc)
        return {}


def _fake_run(gm: fx.GraphModule, inputs: Sequence[torch.Tensor], device_type: str,
              grad: bool, loss_fn: Callable[..., Any] | None = None, targets: Any = None
              ) -> _FakeAutocastRun:
    # An explicit index: fake "cuda" tensors without one ask the CUDA runtime for the device.
    run = _FakeAutocastRun(gm, torch.device(device_type, 0), grad)
    with FakeTensorMode(), _autocast_rules("cpu"), _autocast_rules(device_type), \
            torch.set_grad_enabled(grad):
        output = run.run(*(run.fake(t) for t in inputs))
        if loss_fn is not None:
            try:  # a loss fake tensors cannot run (.item(), data-dependent ops)
                run.run_loss(loss_fn, output, targets)
            except Exception as exc:
                run.loss_error = exc
    return run


class _FakeAutocastRun(fx.Interpreter):
    """Runs the graph on fake tensors of ``device``; parameters and buffers, which live on the
    meta device (where autocast does not apply), are replaced by fake ones of ``device``.
    Records each value's dtype and what each compute node saves for backward."""

    def __init__(self, gm: fx.GraphModule, device: torch.device, grad: bool) -> None:
        super().__init__(gm)
        self.device, self.grad = device, grad
        self.dtypes: dict[str, str] = {}
        self.saved: dict[str, int] = defaultdict(int)
        self.loss_saved = 0
        self.loss_error: Exception | None = None
        self.maker: dict[int, str] = {}  # storage -> the compute node that made it ("": none)
        self.counted: set[int] = set()
        self.keep_alive: list[torch.Tensor] = []  # storages are keyed by address

    def run_node(self, n: fx.Node) -> Any:
        saved: list[torch.Tensor] = []
        with _saved_into(saved):
            try:
                value = super().run_node(n)
            except Exception:
                if self.device.type != "cuda" or torch.cuda.is_available():
                    raise
                value = self._on_cpu(n)
        if isinstance(value, torch.Tensor) and n.op != "output":
            self.dtypes[n.name] = str(value.dtype).removeprefix("torch.")
        made_by = n.name if n.op in COMPUTE_OPS else ""
        for tensor in flat_tensors(value):
            self.maker.setdefault(_storage(tensor), made_by)
        if n.op in COMPUTE_OPS:
            self._credit(saved, n.name)
        self.keep_alive += [*saved, *flat_tensors(value)]
        return value

    def _credit(self, saved: list[torch.Tensor], node: str) -> None:
        """Count each saved storage once, with the node that made it (``node`` when none
        did); weights, and autocast's bf16 copies of them, are static memory."""
        for tensor in saved:
            storage = _storage(tensor)
            if storage in self.counted:
                continue
            self.counted.add(storage)
            maker = self.maker.get(storage)
            if maker is None and _from_a_weight(tensor):
                continue
            if maker != "":  # the graph's inputs, parameters and buffers are not activations
                self.saved[maker or node] += int(tensor.untyped_storage().nbytes())

    def run_loss(self, loss_fn: Callable[..., Any], output: Any, targets: Any) -> None:
        """``loss_fn`` on leaves standing for the last stage's output, as the runtime calls it:
        the bytes it saves beyond its inputs."""
        output = fx.node.map_aggregate(output, lambda t: _leaf(t) if isinstance(
            t, torch.Tensor) and t.is_floating_point() else t)
        targets = fx.node.map_aggregate(targets, self.fake)
        saved: list[torch.Tensor] = []
        with _saved_into(saved):
            loss_fn(output, targets)
        inputs = {_storage(t) for t in flat_tensors((output, targets))}
        own = {_storage(t): int(t.untyped_storage().nbytes()) for t in saved
               if _storage(t) not in inputs}
        self.loss_saved = sum(own.values())
        self.keep_alive += saved

    def _on_cpu(self, n: fx.Node) -> Any:
        """Run ``n`` on fake CPU tensors, under CPU autocast's rules: a PyTorch built without
        CUDA cannot run some ops on fake CUDA tensors (a batch norm's running-statistics update,
        indexing), none of them one whose dtype CPU and CUDA autocast decide differently."""
        cuda, self.device = self.device, torch.device("cpu")
        try:
            args, kwargs = fx.node.map_aggregate(self.fetch_args_kwargs_from_env(n), self.fake)
            value = getattr(self, n.op)(n.target, args, kwargs)
        finally:
            self.device = cuda
        return fx.node.map_aggregate(value, self.fake)

    def fake(self, value: Any) -> Any:
        """A fake tensor of this run's device with ``value``'s layout (a parameter's
        requires_grad too, so that autograd saves what training saves)."""
        if not isinstance(value, torch.Tensor):
            return value
        fake = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                   device=self.device)
        return fake.requires_grad_(self.grad and value.requires_grad
                                   and value.is_floating_point())

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        return self.fake(super().get_attr(target, args, kwargs))

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        module = self.fetch_attr(str(target))
        tensors = {name: self.fake(t) for name, t in (*module.named_parameters(),
                                                      *module.named_buffers())}
        return torch.func.functional_call(module, tensors, args, kwargs)

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        return super().call_function(target, *self._off_meta(args, kwargs))

    def call_method(self, target: Any, args: Any, kwargs: Any) -> Any:
        return super().call_method(target, *self._off_meta(args, kwargs))

    def _off_meta(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """torch.export records the device it traced on (meta) in factory calls (arange)."""
        def move(value: Any) -> Any:
            is_meta = isinstance(value, torch.device) and value.type == "meta"
            return self.device if is_meta else value
        return fx.node.map_aggregate(args, move), fx.node.map_aggregate(kwargs, move)


@contextlib.contextmanager
def _autocast_rules(device_type: str) -> Iterator[None]:
    """bf16 autocast on ``device_type``, set directly: ``torch.autocast("cuda")`` turns itself
    off on a machine without CUDA, though its rules need none to apply to fake tensors."""
    enabled = torch.is_autocast_enabled(device_type)
    dtype = torch.get_autocast_dtype(device_type)
    torch.set_autocast_enabled(device_type, True)
    torch.set_autocast_dtype(device_type, AUTOCAST_DTYPE)
    try:
        yield
    finally:
        torch.set_autocast_enabled(device_type, enabled)
        torch.set_autocast_dtype(device_type, dtype)
        torch.clear_autocast_cache()


@contextlib.contextmanager
def _saved_into(saved: list[torch.Tensor]) -> Iterator[None]:
    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield


# Autograd nodes that copy, cast or view one tensor: a weight seen through them is still the
# weight (autocast's bf16 copy of it, or that copy transposed for a matmul's backward).
_COPIES_AND_VIEWS = frozenset({"ToCopyBackward0", "TBackward0", "TransposeBackward0",
                               "PermuteBackward0", "ViewBackward0", "UnsafeViewBackward0",
                               "ExpandBackward0"})


def _from_a_weight(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a weight (a leaf that requires grad: the data does not), or a
    copy or view of one alone."""
    step = tensor.grad_fn
    while step is not None and type(step).__name__ in _COPIES_AND_VIEWS:
        step = step.next_functions[0][0]
    if step is None:
        return tensor.requires_grad and tensor.grad_fn is None
    return type(step).__name__ == "AccumulateGrad"


def _storage(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage()._cdata)


def _leaf(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().requires_grad_()
