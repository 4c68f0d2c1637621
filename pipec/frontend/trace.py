"""Trace pass: build the model on the meta device and capture its graph with torch.fx."""

from __future__ import annotations

import contextlib
import inspect
import operator
import os
import sys
import tempfile
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn

from pipec.errors import ConfigError, ModelFileError, TraceError
from pipec.frontend.fakedevice import FakeDevice, on_fake_device, short_read, to_meta, trace_device
from pipec.frontend.loader import ModelSpec, user_frame
from pipec.torchcompat import GRAD_MODE_REGION, output_structure, runtime_compat


@dataclass(frozen=True)
class Traced:
    """The model's fx graph, built on meta (no weight is allocated), and its input names;
    the device it was traced on (pipec.frontend.fakedevice) and where model code read a tensor's
    device while tracing ("file:line")."""

    graph_module: fx.GraphModule
    input_names: tuple[str, ...]
    frontend: str
    device: str = "meta"
    device_reads: tuple[str, ...] = ()
    # torch's pytree JSON of forward's output (a ModelOutput, a dict ...) for loss_fn; None
    # when it is a tensor or a tuple of tensors, which the last stage returns as they are.
    output_structure: str | None = None
    # Constants the traced code made (torch.export's lifted tensors), by path: their values.
    constants: tuple[tuple[str, torch.Tensor], ...] = ()


FRONTENDS = ("auto", "fx", "export")
# Calls that torch.export leaves in its graph to check shapes and metadata at run time: they
# record the meta device pipec traced on, so the emitted stages drop them.
_EXPORT_CHECKS = ("_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range",
                  "_assert_async")


def trace_model(spec: ModelSpec, frontend: str = "auto", device_type: str = "cpu") -> Traced:
    """Build ``spec``'s model under ``torch.device("meta")`` and capture its graph, its weights
    and inputs faking ``device_type`` (the plan's: "cpu" or "cuda"): with
    ``torch.fx.symbolic_trace``, or ``torch.export`` for models fx cannot trace ("auto" tries
    fx first)."""
    if frontend not in FRONTENDS:
        raise ConfigError(f"--frontend {frontend!r}: use one of {', '.join(FRONTENDS)}")
    with torch.device("meta"):
        model = spec.build_model()
    if not isinstance(model, nn.Module):
        raise ModelFileError(f"{spec.path}: build_model() returned {type(model).__name__}, "
                             "expected a torch.nn.Module")
    device = trace_device(device_type)
    if frontend == "export":
        return _export(spec, model, device)
    try:
        return _symbolic_trace(spec, model, device)
    except TraceError as fx_error:
        if frontend == "fx":
            raise TraceError(f"{fx_error}; try --frontend export") from None
        try:
            return _export(spec, model, device)
        except TraceError as export_error:
            raise TraceError(f"{fx_error}; and with --frontend export: {export_error}") from None


def _symbolic_trace(spec: ModelSpec, model: nn.Module, device: str) -> Traced:
    defaults = _defaults_not_supplied(model, len(batch_inputs(spec, 1)[0]))
    with on_fake_device(model, device) as faked:
        try:
            graph_module = _fx_graph(model, defaults)
        except Exception as exc:
            raise TraceError(f"{user_frame(spec.path, exc)}: torch.fx cannot trace the model: "
                             f"{type(exc).__name__}: {_first_line(exc)}") from None
    _drop_specialized_inputs(graph_module, len(defaults))
    _require_plain_output(spec, graph_module)
    return _traced(graph_module, "fx", faked)


def _fx_graph(model: nn.Module, defaults: dict[str, Any]) -> fx.GraphModule:
    """fx.symbolic_trace, with reads of buffers recorded as graph values: by default fx computes
    what forward derives from a buffer (timm's ``relative_position_index.view(-1)``) while
    tracing and keeps the result as a constant, whose value a model built on meta lacks."""
    tracer = fx.Tracer()
    tracer.proxy_buffer_attributes = True
    graph = tracer.trace(model, concrete_args=defaults or None)
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


def _require_plain_output(spec: ModelSpec, graph_module: fx.GraphModule) -> None:
    """fx records an output object (XLNet's ModelOutput) as a dict, which loss_fn does not
    expect: such a model goes to torch.export, which keeps the object's type."""
    output = next(n for n in graph_module.graph.nodes if n.op == "output").args[0]
    values = output if isinstance(output, tuple | list) else (output,)
    if not all(isinstance(v, fx.Node) for v in values):
        raise TraceError(f"{spec.path}: torch.fx records forward's output as a plain "
                         "container (an object or dict), which --frontend export keeps")


def _traced(graph_module: fx.GraphModule, frontend: str, faked: FakeDevice) -> Traced:
    to_meta(graph_module, faked)
    return Traced(graph_module, _input_names(graph_module), frontend, faked.device.type,
                  tuple(faked.reads), constants=tuple(sorted(faked.constants.items())))


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


def _export(spec: ModelSpec, model: nn.Module, device: str) -> Traced:
    """torch.export (non-strict) on inputs of batch 2, the batch dimension dynamic, so that
    the graph holds for every micro-batch size."""
    with on_fake_device(model, device) as faked, _torch_log_to_file() as log:
        inputs = tuple(faked.fake(t.to("meta")) for t in batch_inputs(spec, 2)[0])
        dims = tuple({0: torch.export.Dim.AUTO} for _ in inputs)
        try:
            program = torch.export.export(model, inputs, dynamic_shapes=dims, strict=False)
        except Exception as exc:
            fix = _known_fix(exc)
            message = _first_line(exc).split(". ")[0] if fix else _first_line(exc)
            raise TraceError(f"{_failing_frame(spec.path, exc)}: torch.export cannot capture "
                             f"the model: {type(exc).__name__}: {message}{fix} (torch's log: "
                             f"{log})") from None
        graph_module = program.module()
    if not isinstance(graph_module, fx.GraphModule):
        raise TraceError(f"{spec.path}: torch.export returned no graph module")
    _drop_runtime_checks(graph_module)
    _inline_grad_regions(graph_module)
    traced = _traced(graph_module, "export", faked)
    return replace(traced, output_structure=_output_structure(spec, program))


# Export failures with a known cause in model code: (words in torch's message, the fix).
_EXPORT_FIXES = (
    (("Cache'> in output", "Cache is not", "past_key_values"),
     "the model returns its key/value cache: set use_cache=False in its config (or call it "
     "from a wrapper that returns the logits)"),
    (("data-dependent", "data dependent"),
     "the code branches or loops on a tensor's values: write it with torch.where or "
     "torch.cond, or choose the library's option that avoids the loop (a Hugging Face MoE: "
     "the config's default experts implementation)"),
)


def _known_fix(exc: BaseException) -> str:
    text = str(exc)
    return next((f"; {fix}" for words, fix in _EXPORT_FIXES if any(w in text for w in words)),
                "")


def _failing_frame(path: Path, exc: BaseException) -> str:
    """The innermost frame of the traceback in model code (the model file's, or a library's
    such as transformers'), not torch's, pipec's or Python's; with the model file's line that
    led there when they differ."""
    mine = user_frame(path, exc)
    skip = (os.path.dirname(torch.__file__), os.path.dirname(__file__),
            os.path.dirname(os.__file__))
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith(skip) and not f.filename.startswith("<")]
    if not frames or Path(frames[-1].filename).resolve() == path.resolve():
        return mine
    library = short_read(f"{frames[-1].filename}:{frames[-1].lineno}")
    return f"{library} (from {mine})"


def _output_structure(spec: ModelSpec, program: torch.export.ExportedProgram) -> str | None:
    structure = program.call_spec.out_spec
    try:
        return output_structure(structure)
    except (TypeError, NotImplementedError) as exc:
        raise ModelFileError(
            f"{spec.path}: forward returns a {getattr(structure.type, '__name__', structure.type)}"
            f", which pipec cannot rebuild for loss_fn ({_first_line(exc)}); return a tensor, a "
            "tuple or a dict of tensors (or a Hugging Face ModelOutput)") from None


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


def _inline_grad_regions(graph_module: fx.GraphModule) -> None:
    """torch.export puts a ``torch.no_grad()`` region (M2M100's positions) in a submodule,
    called by ``wrap_with_set_grad_enabled``: its nodes go into the main graph, each value it
    returns detached (the same values, and no gradient flows back through them), so that the
    stages need no submodule of the graph's own."""
    region = GRAD_MODE_REGION
    for node in [n for n in graph_module.graph.nodes if n.target is region]:
        enabled, submodule, *operands = node.args
        body = getattr(graph_module, submodule.target)
        with graph_module.graph.inserting_before(node):
            returned = _copy_region(graph_module.graph, body, operands, bool(enabled))
        for user in list(node.users):
            if user.target is operator.getitem:
                user.replace_all_uses_with(returned[user.args[1]])
                graph_module.graph.erase_node(user)
        if node.users:
            raise TraceError(f"{node.format_node()}: a grad-mode region whose result is used "
                             "whole; pipec inlines regions read by index only")
        graph_module.graph.erase_node(node)
        if not any(n.target == submodule.target for n in graph_module.graph.nodes
                   if n is not submodule and n.op == "get_attr"):
            graph_module.graph.erase_node(submodule)
            graph_module.delete_submodule(submodule.target)
    graph_module.recompile()


def _copy_region(graph: fx.Graph, body: fx.GraphModule, operands: list[Any], enabled: bool
                 ) -> list[Any]:
    """The region's nodes copied into ``graph`` (at its insertion point); what it returns."""
    values: dict[fx.Node, Any] = {}
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    values.update(zip(placeholders, operands, strict=True))
    returned: list[Any] = []
    for inner in body.graph.nodes:
        if inner.op == "get_attr":
            raise TraceError(f"{inner.format_node()}: a grad-mode region that reads an "
                             "attribute of its own")
        if inner.op == "output":
            outputs = inner.args[0]
            returned = list(outputs) if isinstance(outputs, tuple | list) else [outputs]
        elif inner.op != "placeholder":
            values[inner] = graph.node_copy(inner, lambda n: values[n])
    mapped = [fx.node.map_arg(r, lambda n: values[n]) for r in returned]
    return mapped if enabled else [_detached(graph, value) for value in mapped]


def _detached(graph: fx.Graph, value: Any) -> Any:
    if not isinstance(value, fx.Node) or not isinstance(value.meta.get("val"), torch.Tensor):
        return value
    detached = graph.call_function(torch.ops.aten.detach.default, (value,))
    detached.meta["val"] = value.meta["val"]
    return detached


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


def model_loss(spec: ModelSpec, traced: Traced) -> Any:
    """The model file's loss (cross-entropy by default), given the model's output as forward
    returns it: a ModelOutput or dict is rebuilt from the graph's tensors, as the emitted
    script rebuilds it from the last stage's."""
    loss_fn = getattr(spec.module, "loss_fn", nn.functional.cross_entropy)
    if traced.output_structure is None:
        return loss_fn
    compat = runtime_compat()
    structure = compat.output_structure(traced.output_structure)
    return lambda output, targets: loss_fn(compat.rebuild_output(output, structure), targets)
