"""The torch releases pipec supports, and every torch internal pipec itself uses, by release.

The emitted script has its own counterpart, ``torch_compat.py`` (templates/torch_compat.py.j2),
for the pipeline runtime's internals: the two are the only places that name a torch private.
pipec's probes load that same module (``runtime_compat``), so that they run torch's pipeline
runtime as the training does.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
from collections.abc import Callable, Iterable, Iterator
from importlib import resources
from types import ModuleType
from typing import Any

import jinja2
import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from pipec import __version__
from pipec.errors import PipecError

__all__ = [
    "GRAD_MODE_REGION",
    "SUPPORTED_PIP",
    "SUPPORTED_TORCH",
    "FakeTensor",
    "FakeTensorMode",
    "TorchDispatchMode",
    "UnsupportedTorchError",
    "backward_input",
    "can_fake",
    "check_torch",
    "counting_fsdp_reductions",
    "cpu_only_fakes",
    "device_reads",
    "fake_constant",
    "fake_on_device",
    "output_structure",
    "pipeline_backward",
    "release",
    "runtime_compat",
]

# The oldest and newest torch releases (major, minor) the test suite runs on (.ci/run).
SUPPORTED_TORCH = ((2, 11), (2, 14))
SUPPORTED_PIP = "torch>=2.11,<2.15"


class UnsupportedTorchError(PipecError):
    """The installed torch is outside the tested range."""


def release(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of a torch version such as '2.11.0+cu130' (the installed one by default)."""
    major, minor = (version or torch.__version__).split("+")[0].split(".")[:2]
    return int(major), int(minor)


def check_torch(version: str | None = None) -> None:
    """Raise UnsupportedTorchError for a torch release pipec was not tested with."""
    version = version or torch.__version__
    if not SUPPORTED_TORCH[0] <= release(version) <= SUPPORTED_TORCH[1]:
        oldest, newest = (".".join(map(str, r)) for r in SUPPORTED_TORCH)
        raise UnsupportedTorchError(
            f"torch {version} is not supported: pipec and the scripts it writes run on torch "
            f"{oldest} to {newest}; install one (pip install '{SUPPORTED_PIP}')")


def can_fake(device_type: str) -> bool:
    """Whether pipec fakes ``device_type`` here: the CPU always; CUDA only where a GPU is
    visible. A CPU-only build aborts the process on a fake CUDA tensor; a CUDA build without a
    GPU fakes it by installing a no-op CUDA device guard for good, after which autograd starts
    device threads and processes forked later (pipec's probes, the tests' ranks) cannot run a
    backward."""
    return device_type == "cpu" or (device_type == "cuda" and torch.cuda.is_available())


@contextlib.contextmanager
def cpu_only_fakes() -> Iterator[None]:
    """Within the block, every FakeTensorMode (torch.export enters several of its own) fakes
    without preparing a CUDA device: where no accelerator is visible, FakeTensorMode.__enter__
    otherwise installs the no-op CUDA device guard for good (see can_fake). For traces on the
    CPU, which need no CUDA. ``avoid_device_init`` is a property on every supported release."""
    original = FakeTensorMode.__dict__["avoid_device_init"]
    FakeTensorMode.avoid_device_init = property(lambda mode: False)  # type: ignore[assignment,method-assign]
    try:
        yield
    finally:
        FakeTensorMode.avoid_device_init = original  # type: ignore[method-assign]


# Where FSDP2 keeps the function that reduces one unit's gradients (its reduce-scatter, and the
# replicas' all-reduce under HSDP), by release: the same module in every supported one.
FSDP_REDUCE = {(2, minor): ("torch.distributed.fsdp._fully_shard._fsdp_param_group",
                             "foreach_reduce")
               for minor in range(SUPPORTED_TORCH[0][1], SUPPORTED_TORCH[1][1] + 1)}


@contextlib.contextmanager
def counting_fsdp_reductions(record: Callable[[], None]) -> Iterator[None]:
    """Within the block, ``record()`` runs each time FSDP2 reduces a unit's gradients, in this
    process and in the processes forked inside the block. FSDP2 has no public hook for it, so
    this wraps its private function (FSDP_REDUCE); tests count reductions with it."""
    check_torch()
    module_name, name = FSDP_REDUCE[release()]
    module = importlib.import_module(module_name)
    reduce = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        record()
        return reduce(*args, **kwargs)

    setattr(module, name, counted)
    try:
        yield
    finally:
        setattr(module, name, reduce)


# torch.export's call of a torch.no_grad() (or enable_grad) region kept in a submodule graph.
GRAD_MODE_REGION = torch.ops.higher_order.wrap_with_set_grad_enabled


def fake_constant(tensor: FakeTensor) -> torch.Tensor | None:
    """The real value a fake tensor made from Python data carries, if it does."""
    value = getattr(tensor, "constant", None)
    return value if isinstance(value, torch.Tensor) else None


def fake_on_device(mode: FakeTensorMode, meta: torch.Tensor, device: torch.device) -> FakeTensor:
    """A fake tensor of ``mode`` with ``meta``'s shape, strides and dtype that reports
    ``device``: nothing is allocated, and code that reads its device sees the one the run has."""
    return mode.fake_tensor_converter.from_meta_and_device(mode, meta, device)


@contextlib.contextmanager
def device_reads(skip: tuple[str, ...]) -> Iterator[list[str]]:
    """Record where code outside the ``skip`` directories (torch's, pipec's) reads a fake
    tensor's device, as "file:line", while the block runs. FakeTensor.device is a Python
    property on every supported release; it is wrapped for the block only."""
    reads: list[str] = []
    original = FakeTensor.__dict__["device"]

    def read(tensor: FakeTensor) -> torch.device:
        caller = sys._getframe(1)
        if not caller.f_code.co_filename.startswith(skip):
            reads.append(f"{caller.f_code.co_filename}:{caller.f_lineno}")
        return original.fget(tensor)

    FakeTensor.device = property(read, original.fset)  # type: ignore[method-assign,assignment]
    try:
        yield reads
    finally:
        FakeTensor.device = original  # type: ignore[method-assign]


def output_structure(structure: pytree.TreeSpec) -> str | None:
    """torch.export's output structure as JSON for the emitted script, or None for the outputs
    the stages return as they are: a tensor, or a tuple or list of tensors. Raises TypeError for
    a type pytree cannot write (one registered without a serialized name)."""
    plain = structure.is_leaf() or (structure.type in (tuple, list) and all(
        child.is_leaf() for child in structure.children_specs))
    return None if plain else pytree.treespec_dumps(structure)


def pipeline_backward(outputs: list[torch.Tensor], gradients: list[torch.Tensor],
                      inputs: list[torch.Tensor], weights: Iterable[torch.nn.Parameter],
                      split: bool) -> None:
    """A stage's backward as torch's pipeline runtime runs it: whole, or split into the
    inputs' gradients and then the weights' (the zero-bubble schedules). Imported here, not
    above: loading torch.distributed.pipelining takes seconds, and only measurements need it."""
    from torch.distributed.pipelining import _backward

    if not split:
        _backward.stage_backward(outputs, gradients, inputs)
        return
    weights = list(weights)
    groups = backward_input(outputs, gradients, inputs, weights)
    runtime_compat().weight_gradients(weights, groups)


def backward_input(outputs: list[torch.Tensor], gradients: list[torch.Tensor],
                   inputs: list[torch.Tensor], weights: Iterable[torch.nn.Parameter]
                   ) -> list[dict[str, Any]]:
    """The inputs' gradients of a split backward; returns torch's weight groups, which hold
    what the weights' pass still needs (``groups[i]["grads"]``: the weight operations' output
    gradients)."""
    from torch.distributed.pipelining import _backward

    _, groups = _backward.stage_backward_input(outputs, gradients, inputs, iter(weights))
    return list(groups)


@functools.cache
def runtime_compat() -> ModuleType:
    """The emitted script's torch_compat module, rendered and loaded in this process."""
    template = resources.files("pipec.templates").joinpath("torch_compat.py.j2").read_text()
    source = jinja2.Template(template, keep_trailing_newline=True).render(
        version=__version__, supported_torch=SUPPORTED_TORCH, supported_pip=SUPPORTED_PIP)
    module = ModuleType("torch_compat")
    exec(compile(source, "torch_compat.py", "exec"), module.__dict__)
    return module
