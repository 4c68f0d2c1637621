"""The dtype of each value of the traced graph under bf16 autocast, found without running it.

The training script runs every stage under ``torch.autocast(dtype=torch.bfloat16)``: a Linear
returns bf16, but the sum ``x + f(x)`` of an fp32 residual stream and a bf16 branch is fp32 again,
and on CUDA ``layer_norm`` and ``softmax`` return fp32. A stage boundary must carry the dtype the
single-device autocast run has there, or an fp32 value is rounded to bf16 at the cuts only and
the numerics depend on the partition. So the graph runs once on fake tensors (shapes and dtypes,
no data) of the target device type, under that device type's autocast rules, which differ
between CPU and CUDA.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

log = logging.getLogger(__name__)

AUTOCAST_DTYPE = torch.bfloat16


def autocast_dtypes(gm: fx.GraphModule, inputs: Sequence[torch.Tensor],
                    device_type: str) -> dict[str, str]:
    """Each tensor value's dtype name under bf16 autocast on ``device_type`` ("cuda" or "cpu"),
    by node name. Empty, with a warning, when the graph cannot run on fake tensors: the caller
    then keeps the values' fp32 dtypes (never rounding at a cut, at twice the bytes)."""
    # An explicit index: fake "cuda" tensors without one ask the CUDA runtime for the device.
    run = _FakeAutocastRun(gm, torch.device(device_type, 0))
    try:
        with FakeTensorMode(), _autocast_rules("cpu"), _autocast_rules(device_type), \
                torch.no_grad():
            run.run(*(run.fake(t) for t in inputs))
    except Exception as exc:  # a model that fake tensors cannot run still compiles
        log.warning("could not find the dtypes under %s bf16 autocast (%s: %s); stage "
                    "boundaries keep each value's fp32 dtype", device_type,
                    type(exc).__name__, exc)
        return {}
    return run.dtypes


class _FakeAutocastRun(fx.Interpreter):
    """Runs the graph on fake tensors of ``device``; parameters and buffers, which live on the
    meta device (where autocast does not apply), are replaced by fake ones of ``device``."""

    def __init__(self, gm: fx.GraphModule, device: torch.device) -> None:
        super().__init__(gm)
        self.device = device
        self.dtypes: dict[str, str] = {}

    def run_node(self, n: fx.Node) -> Any:
        try:
            value = super().run_node(n)
        except Exception:
            if self.device.type != "cuda" or torch.cuda.is_available():
                raise
            value = self._on_cpu(n)
        if isinstance(value, torch.Tensor) and n.op != "output":
            self.dtypes[n.name] = str(value.dtype).removeprefix("torch.")
        return value

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
        if not isinstance(value, torch.Tensor):
            return value
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                   device=self.device)

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
