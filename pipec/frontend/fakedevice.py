"""Trace on the device type the plan trains on, without allocating: the model's weights and the
sample inputs become fake tensors that report that device, so code that branches on
``x.device.type`` (Hugging Face's Mixtral experts pick a ``histc`` dtype that way) takes the
branch the run will take. After tracing, the graph goes back to meta tensors, which the passes
after the trace measure on; its device constants become meta, which the split turns into the
stage's run device."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import fx, nn

import pipec
from pipec.torchcompat import (
    FakeTensor,
    FakeTensorMode,
    can_fake,
    cpu_only_fakes,
    device_reads,
    fake_constant,
    fake_on_device,
)

__all__ = ["FakeDevice", "on_fake_device", "short_read", "to_meta", "trace_device"]

# Reads of a tensor's device inside these packages are torch's own bookkeeping, not model code.
_NOT_MODEL_CODE = (os.path.dirname(torch.__file__), os.path.dirname(pipec.__file__))


def trace_device(device_type: str) -> str:
    """The device the trace fakes: the plan's ("cpu" or "cuda"), or "meta" where pipec does
    not fake it (CUDA where no GPU is visible: torchcompat.can_fake)."""
    return device_type if can_fake(device_type) else "meta"


@dataclass
class FakeDevice:
    """The fake tensors standing in for a model's weights while it is traced."""

    device: torch.device
    mode: FakeTensorMode | None
    # id(fake) -> (fake, its meta original): holding the fake keeps its id from being reused.
    originals: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    reads: list[str] = field(default_factory=list)
    # Tensors the traced code made from Python values (torch.tensor(8.0)), which torch.export
    # lifts into constants, by their path in the graph module: their values, for the stages.
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    # id(tensor) -> (tensor, its meta stand-in) for tensors with no meta original.
    converted: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def fake(self, meta: torch.Tensor) -> torch.Tensor:
        if self.mode is None:
            return meta
        fake = fake_on_device(self.mode, meta, self.device)
        self.originals[id(fake)] = (fake, meta)
        return fake


@contextlib.contextmanager
def on_fake_device(model: nn.Module, device: str) -> Iterator[FakeDevice]:
    """Within the block, ``model``'s (meta) parameters and buffers are fakes on ``device``;
    ``FakeDevice.fake`` makes the inputs, and ``reads`` lists where model code read a fake
    tensor's device. On "meta" nothing is swapped."""
    faked = FakeDevice(torch.device(device), None if device == "meta" else FakeTensorMode())
    with cpu_only_fakes() if device == "cpu" else contextlib.nullcontext():
        swapped = _swap(model, faked)
        try:
            with device_reads(_NOT_MODEL_CODE) as reads:
                yield faked
            faked.reads[:] = list(dict.fromkeys(reads))
        finally:
            for module, slot, name, tensor in swapped:
                getattr(module, slot)[name] = tensor


def _swap(model: nn.Module, faked: FakeDevice
          ) -> list[tuple[nn.Module, str, str, torch.Tensor]]:
    if faked.mode is None:
        return []
    swapped: list[tuple[nn.Module, str, str, torch.Tensor]] = []
    fakes: dict[int, torch.Tensor] = {}  # a tied weight stays one tensor
    for module in model.modules():
        for slot in ("_parameters", "_buffers"):
            for name, tensor in getattr(module, slot).items():
                if tensor is None:
                    continue
                if id(tensor) not in fakes:
                    fakes[id(tensor)] = _fake_like(tensor, faked)
                getattr(module, slot)[name] = fakes[id(tensor)]
                swapped.append((module, slot, name, tensor))
    return swapped


def _fake_like(tensor: torch.Tensor, faked: FakeDevice) -> torch.Tensor:
    fake = faked.fake(tensor.detach().to("meta"))  # a tensor made on the CPU despite meta
    if not isinstance(tensor, nn.Parameter):
        faked.originals[id(fake)] = (fake, tensor)
        return fake
    parameter = nn.Parameter(fake, requires_grad=tensor.requires_grad)
    faked.originals[id(parameter)] = (parameter, tensor)
    return parameter


def to_meta(graph_module: fx.GraphModule, faked: FakeDevice) -> None:
    """Every fake tensor ``graph_module`` holds back to its meta original (a fresh meta tensor
    for a constant the trace made), and every use of the faked device in the graph to meta."""
    for prefix, module in graph_module.named_modules():
        for slot in ("_parameters", "_buffers"):
            for name, tensor in getattr(module, slot).items():
                # A weight made on the CPU in spite of the meta device (XLNet's, by the legacy
                # torch.FloatTensor constructor) goes to meta too: the passes run on meta.
                if tensor is not None and (isinstance(tensor, FakeTensor) or not tensor.is_meta):
                    getattr(module, slot)[name] = _meta_of(tensor, faked)
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                _keep_constant(f"{prefix}.{name}".lstrip("."), value, faked)
                setattr(module, name, _meta_of(value, faked))
    if faked.mode is None:
        return
    # Every graph: torch.export puts a region such as torch.no_grad() in a submodule's graph.
    for graph in (m for m in graph_module.modules() if isinstance(m, fx.GraphModule)):
        for node in graph.graph.nodes:
            node.args = fx.node.map_aggregate(node.args, lambda a: _meta_device(a, faked.device))
            node.kwargs = fx.node.map_aggregate(
                node.kwargs, lambda a: _meta_device(a, faked.device))
        graph.recompile()


def _keep_constant(path: str, tensor: torch.Tensor, faked: FakeDevice) -> None:
    """The value of a constant the traced code made (torch.export lifts it into a plain
    attribute): a real tensor, or a fake one that knows its value."""
    value = fake_constant(tensor) if isinstance(tensor, FakeTensor) else tensor
    if isinstance(value, torch.Tensor) and value.device.type != "meta":
        faked.constants[path] = value.detach().clone()


def _meta_of(tensor: torch.Tensor, faked: FakeDevice) -> torch.Tensor:
    fake, original = faked.originals.get(id(tensor), (None, None))
    if fake is tensor and original is not None and original.is_meta:
        return original
    if id(tensor) not in faked.converted:  # one meta tensor for each: ties stay ties
        meta = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype,
                                   device="meta")
        faked.converted[id(tensor)] = (tensor, nn.Parameter(meta, tensor.requires_grad)
                                       if isinstance(tensor, nn.Parameter) else meta)
    return faked.converted[id(tensor)][1]


def _meta_device(arg: object, device: torch.device) -> object:
    if isinstance(arg, torch.device) and arg.type == device.type:
        return torch.device("meta")
    return arg


def short_read(read: str) -> str:
    """A read's ``file:line`` without the directories a reader does not need (and no absolute
    path in the output): from the package below site-packages on, or the file's name."""
    path, _, line = read.rpartition(":")
    short = path.split("site-packages/")[-1] if "site-packages/" in path else path.split("/")[-1]
    return f"{short}:{line}"
