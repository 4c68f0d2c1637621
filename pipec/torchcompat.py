"""The torch releases pipec supports, and every torch internal pipec itself uses, by release.

The emitted script has its own counterpart, ``torch_compat.py`` (templates/torch_compat.py.j2),
for the pipeline runtime's internals: the two are the only places that name a torch private.
pipec's probes load that same module (``runtime_compat``), so that they run torch's pipeline
runtime as the training does.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from importlib import resources
from types import ModuleType
from typing import Any

import jinja2
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from pipec import __version__
from pipec.errors import PipecError

__all__ = ["SUPPORTED_PIP", "SUPPORTED_TORCH", "FakeTensorMode", "TorchDispatchMode",
           "UnsupportedTorchError", "backward_input", "check_torch", "pipeline_backward", "release",
           "runtime_compat"]

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
    _backward.stage_backward_weight(iter(weights), groups)


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
