"""Trace pass: build the model on the meta device and capture its graph with torch.fx."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx, nn

from pipec.errors import ModelFileError, TraceError
from pipec.loader import ModelSpec, user_frame


@dataclass(frozen=True)
class Traced:
    """The model's fx graph, built on meta (no weight is allocated), and its input names."""

    graph_module: fx.GraphModule
    input_names: tuple[str, ...]
    frontend: str


def trace_model(spec: ModelSpec) -> Traced:
    """Build ``spec``'s model under ``torch.device("meta")`` and ``symbolic_trace`` it."""
    with torch.device("meta"):
        model = spec.build_model()
    if not isinstance(model, nn.Module):
        raise ModelFileError(f"{spec.path}: build_model() returned {type(model).__name__}, "
                             "expected a torch.nn.Module")
    try:
        graph_module = fx.symbolic_trace(model)
    except Exception as exc:
        raise TraceError(f"{user_frame(spec.path, exc)}: torch.fx cannot trace the model: "
                         f"{type(exc).__name__}: {exc}") from None
    names = tuple(n.target for n in graph_module.graph.nodes if n.op == "placeholder")
    return Traced(graph_module=graph_module, input_names=tuple(map(str, names)), frontend="fx")


def batch_inputs(spec: ModelSpec, batch_size: int) -> tuple[tuple[torch.Tensor, ...], object]:
    """``sample_batch(batch_size)`` as (inputs tuple, targets), checked against the contract."""
    batch = spec.sample_batch(batch_size)
    if not (isinstance(batch, tuple | list) and len(batch) == 2):
        raise ModelFileError(f"{spec.path}: sample_batch() must return (inputs, targets), "
                             f"got {type(batch).__name__}")
    inputs, targets = batch
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else inputs
    if not (isinstance(inputs, tuple | list) and inputs
            and all(isinstance(t, torch.Tensor) for t in inputs)):
        raise ModelFileError(f"{spec.path}: sample_batch() inputs must be a tensor or a tuple "
                             "of tensors (the positional arguments of forward)")
    return tuple(inputs), targets
