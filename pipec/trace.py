"""Trace pass: build the model on the meta device and capture its graph with torch.fx."""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from pipec.errors import ConfigError, ModelFileError, TraceError
from pipec.loader import ModelSpec, user_frame


@dataclass(frozen=True)
class Traced:
    """The model's fx graph, built on meta (no weight is allocated), and its input names."""

    graph_module: fx.GraphModule
    input_names: tuple[str, ...]
    frontend: str


FRONTENDS = ("auto", "fx", "export")
# Calls that torch.export leaves in its graph to check shapes and metadata at run time: they
# record the meta device pipec traced on, so the emitted stages drop them.
_EXPORT_CHECKS = ("_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range",
                  "_assert_async")


def trace_model(spec: ModelSpec, frontend: str = "auto") -> Traced:
    """Build ``spec``'s model under ``torch.device("meta")`` and capture its graph: with
    ``torch.fx.symbolic_trace``, or ``torch.export`` for models fx cannot trace ("auto" tries
    fx first)."""
    if frontend not in FRONTENDS:
        raise ConfigError(f"--frontend {frontend!r}: use one of {', '.join(FRONTENDS)}")
    with torch.device("meta"):
        model = spec.build_model()
    if not isinstance(model, nn.Module):
        raise ModelFileError(f"{spec.path}: build_model() returned {type(model).__name__}, "
                             "expected a torch.nn.Module")
    if frontend == "export":
        return _export(spec, model)
    try:
        return _symbolic_trace(spec, model)
    except TraceError as fx_error:
        if frontend == "fx":
            raise TraceError(f"{fx_error}; try --frontend export") from None
        try:
            return _export(spec, model)
        except TraceError as export_error:
            raise TraceError(f"{fx_error}; and with --frontend export: {export_error}") from None


def _symbolic_trace(spec: ModelSpec, model: nn.Module) -> Traced:
    defaults = _defaults_not_supplied(model, len(batch_inputs(spec, 1)[0]))
    try:
        graph_module = fx.symbolic_trace(model, concrete_args=defaults or None)
    except Exception as exc:
        raise TraceError(f"{user_frame(spec.path, exc)}: torch.fx cannot trace the model: "
                         f"{type(exc).__name__}: {_first_line(exc)}") from None
    _drop_specialized_inputs(graph_module, len(defaults))
    return Traced(graph_module, _input_names(graph_module), "fx")


def _defaults_not_supplied(model: nn.Module, supplied: int) -> dict[str, Any]:
    """forward's parameters after the ``supplied`` positional inputs that have a default (a
    timm block's ``attn_mask=None``): each stays its default, a constant in the graph, as a
    call with ``supplied`` arguments leaves it."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    parameters = [p for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in kinds]
    return {p.name: p.default for p in parameters[supplied:]
            if p.default is not inspect.Parameter.empty}


def _drop_specialized_inputs(graph_module: fx.GraphModule, count: int) -> None:
    """fx keeps each specialized argument as a placeholder (its last ``count``) with checks
    that a call passes the value traced with; the stages take only the real inputs, so the
    placeholders go, with the checks, which nothing else uses."""
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    doomed = set(placeholders[len(placeholders) - count:])
    for node in graph_module.graph.nodes:
        if any(arg in doomed for arg in node.all_input_nodes):
            doomed.add(node)
    for node in reversed(list(graph_module.graph.nodes)):
        if node in doomed:
            if any(user not in doomed for user in node.users):
                raise TraceError(f"{node.format_node()} uses a specialized default argument")
            graph_module.graph.erase_node(node)
    graph_module.recompile()


def _export(spec: ModelSpec, model: nn.Module) -> Traced:
    """torch.export (non-strict) on meta inputs of batch 2, the batch dimension dynamic, so
    that the graph holds for every micro-batch size."""
    inputs = tuple(t.to("meta") for t in batch_inputs(spec, 2)[0])
    dims = tuple({0: torch.export.Dim.AUTO} for _ in inputs)
    with _torch_log_to_file() as log:
        try:
            program = torch.export.export(model, inputs, dynamic_shapes=dims, strict=False)
        except Exception as exc:
            raise TraceError(f"{user_frame(spec.path, exc)}: torch.export cannot capture the "
                             f"model: {type(exc).__name__}: {_first_line(exc)} (torch's log: "
                             f"{log})") from None
    graph_module = program.module()
    if not isinstance(graph_module, fx.GraphModule):
        raise TraceError(f"{spec.path}: torch.export returned no graph module")
    _drop_runtime_checks(graph_module)
    return Traced(graph_module, _input_names(graph_module), "export")


@contextlib.contextmanager
def _torch_log_to_file() -> Iterator[Path]:
    """What torch prints on stderr while torch.export runs goes to a file in the temporary
    directory instead: a failing export prints its graphs (hundreds of lines for a Hugging Face
    model), which would bury pipec's one-line message. The file stays only if it has lines."""
    path = Path(tempfile.gettempdir()) / f"pipec-export-{os.getpid()}.log"
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with path.open("w") as log:
            os.dup2(log.fileno(), 2)
            try:
                yield path
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
    finally:
        os.close(saved)
        if path.exists() and path.stat().st_size == 0:
            path.unlink()


def _drop_runtime_checks(graph_module: fx.GraphModule) -> None:
    for node in reversed(list(graph_module.graph.nodes)):
        name = str(getattr(node.target, "__name__", node.target))
        guards = node.op == "call_module" and node.target == "_guards_fn"
        check = node.op == "call_function" and not node.users and name.startswith(_EXPORT_CHECKS)
        if guards or check:
            graph_module.graph.erase_node(node)
    if hasattr(graph_module, "_guards_fn"):
        graph_module.delete_submodule("_guards_fn")
    # torch.export returns a flat tuple of outputs; a model that returns one tensor, as the
    # model-file contract's loss_fn expects, gets that tensor back.
    output = next(n for n in graph_module.graph.nodes if n.op == "output")
    if isinstance(output.args[0], tuple | list) and len(output.args[0]) == 1:
        output.args = (output.args[0][0],)
    graph_module.recompile()


def _input_names(graph_module: fx.GraphModule) -> tuple[str, ...]:
    return tuple(str(n.target) for n in graph_module.graph.nodes if n.op == "placeholder")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


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
