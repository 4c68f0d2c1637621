"""Split pass: the plan's stages as Python source, one nn.Module class per stage.

Each stage receives every value that is made before it and used at or after it (skip connections
that cross several stages are forwarded stage by stage) and returns the values live after it; the
last stage returns the model's output. Attribute reads (``get_attr``) are repeated in each stage
that needs them. Modules are referenced by their qualified names, so state-dict keys match the
original model.
"""

from __future__ import annotations

import builtins
import inspect
import math
import re
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

import torch
from torch import fx
from torch.fx.graph import PythonCode

from pipec.codegen.local_shards import (
    EMITTED_COLLECTIVES,
    TensorShard,
    parallel_graph,
    stage_embeddings,
    stage_regions,
    tensor_shards,
)
from pipec.codegen.sequence_parallel import EMITTED_SEQUENCE, sequence_parallel_graph
from pipec.errors import TraceError
from pipec.frontend.annotate import COMPUTE_OPS, CostGraph
from pipec.frontend.inplace import overwritten_inputs, storage_roots, written
from pipec.frontend.liveness import rederivable_sizes, shape_symbols
from pipec.frontend.shardable import Region, VocabularyEmbedding
from pipec.frontend.trace import Traced
from pipec.planning.planner import Plan
from pipec.planning.sharding import block_units


@dataclass(frozen=True)
class Boundary:
    """One tensor a stage receives or sends, at the plan's micro-batch size."""

    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool


@dataclass(frozen=True)
class StageCode:
    index: int
    class_name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]  # empty for the last stage, which returns the model's output
    module_paths: tuple[str, ...]  # submodules and attributes the stage keeps
    forward_source: str  # ``def forward(self, ...)`` and its body, unindented
    input_specs: tuple[Boundary, ...]
    output_specs: tuple[Boundary, ...]  # for the last stage: the model's output(s)
    # Under sequence parallelism: the parameters the stage's split nodes read, whose gradients
    # are summed over the tp group every step.
    sequence_parameters: tuple[str, ...] = ()
    # Under --fsdp block: the stage's blocks, each the modules FSDP shards as one unit
    # (pipec.planning.sharding.block_units); the rest is the stage's own unit.
    fsdp_units: tuple[tuple[str, ...], ...] = ()


@dataclass(frozen=True)
class Staged:
    stages: tuple[StageCode, ...]
    imports: tuple[str, ...]  # import lines the generated code needs
    # Parameters held by more than one stage (shared modules, tied weights): for each, the
    # (stage index, name in that stage) of every copy. Training sums their gradients.
    tied: tuple[tuple[tuple[int, str], ...], ...] = ()
    # The tensors tp ranks hold a part of (none without tensor parallelism).
    tp_shards: tuple[TensorShard, ...] = ()


def split(traced: Traced, graph: CostGraph, plan: Plan, user_module: str,
          regions: Sequence[Region] = (), embeddings: Sequence[VocabularyEmbedding] = ()
          ) -> Staged:
    """The plan's stages; under tensor parallelism (``regions`` and the vocabulary-parallel
    ``embeddings``, sharded over ``plan.tp`` ranks) each stage as a tp rank runs it
    (pipec.codegen.local_shards)."""
    gm = traced.graph_module
    compute = [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]
    live = graph.live  # annotate's liveness: the values each boundary sends
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    codes: list[StageCode] = []
    imports: dict[str, None] = {}
    roots = storage_roots(gm, compute)
    specs = _Specs(graph, plan, {n.name: root.name for n, root in roots.items()},
                   _grad_by_mutation(gm, compute, roots, graph))
    sent_split: set[str] = set()  # values the stage before sent as each rank's part
    for stage in plan.stages:
        last = stage.index == len(plan.stages) - 1
        outputs = () if last else tuple(live[stage.end])
        nodes = compute[stage.start:stage.end]
        # The first stage takes every model input, used or not: the data arrives whole.
        inputs = placeholders if stage.index == 0 else list(live[stage.start])
        input_specs = specs.of(inputs, stage.start, sent=stage.index > 0)
        # A received floating-point input that the stage overwrites is cloned first:
        # PipelineStage hands it over as a leaf that requires grad (torch 2.11 makes every
        # received float one, whether or not the model's value did), which autograd refuses to
        # overwrite (nn.ReLU(inplace=True) right after the cut). That costs one copy of those
        # inputs only; forbidding such cuts would take away a CNN's natural boundaries (a block
        # often ends in such a ReLU). The first stage's inputs are the data, with no gradient.
        copied = set()
        if stage.index > 0:
            copied = overwritten_inputs(gm, nodes, inputs) & {
                name for name, spec in zip(inputs, input_specs, strict=True)
                if spec.requires_grad or _is_float(spec.dtype)}
        stage_graph, paths, names = _stage_graph(gm, nodes, inputs, outputs, copied,
                                                 rederivable_sizes(compute))
        summed: tuple[str, ...] = ()
        output_specs = specs.of(outputs or _model_outputs(gm), stage.end, sent=not last)
        if regions or embeddings:
            # By the stage's names: its nodes, and its inputs (placeholders of their own names).
            shapes = {names.get(v.name, v.name): v.shape_high for v in graph.values
                      if v.name in names or v.name in inputs}
            received = [n.name for n in stage_graph.nodes if n.op == "placeholder"]
            split_in = {p for p, name in zip(received, inputs, strict=True) if name in sent_split}
            stage_graph, summed, split_out = _tp_rank_graph(
                gm, stage_graph, plan, stage_regions(regions, names),
                stage_embeddings(embeddings, names), shapes, split_in, not last)
            input_specs = _parts(input_specs, [name in sent_split for name in inputs], plan.tp)
            sent_split = set()
            if split_out and not last:
                output_specs = _parts(output_specs, split_out, plan.tp)
                sent_split = {name for name, part in zip(outputs, split_out, strict=True)
                              if part}
        source, lines = _stage_source(stage_graph.python_code(root_module="self"), user_module)
        imports.update(dict.fromkeys(lines))
        codes.append(StageCode(
            stage.index, f"Stage{stage.index}", tuple(inputs), outputs, paths, source,
            input_specs=input_specs, output_specs=output_specs,
            sequence_parameters=summed, fsdp_units=_fsdp_units(gm, stage_graph)))
    shards = tensor_shards({k: v.shape for k, v in gm.state_dict().items()}, regions,
                           embeddings) if regions or embeddings else ()
    return Staged(tuple(codes), tuple(sorted(imports)), tied_parameters(gm, codes), shards)


def _fsdp_units(gm: fx.GraphModule, stage_graph: fx.Graph) -> tuple[tuple[str, ...], ...]:
    """The stage's ``--fsdp block`` units: the modules it calls that hold parameters, by
    block; a block sharing a parameter with a module outside it stays in the stage's unit
    (FSDP shards each parameter in one unit)."""
    calls = [str(n.target) for n in stage_graph.nodes if n.op == "call_module"
             and any(True for _ in gm.get_submodule(str(n.target)).parameters())]
    units: dict[str, list[str]] = {}
    for call, unit in block_units(calls).items():
        units.setdefault(unit, []).append(call)
    read = {str(n.target) for n in stage_graph.nodes if n.op in ("call_module", "get_attr")}

    def held(paths: Iterable[str]) -> set[int]:
        return {id(p) for path in paths for _, p in _parameters_at(gm, path)}

    return tuple(tuple(members) for members in units.values()
                 if not held(members) & held(read - set(members)))


def _tp_rank_graph(gm: fx.GraphModule, stage_graph: fx.Graph, plan: Plan,
                   regions: Sequence[Region], embeddings: Sequence[VocabularyEmbedding],
                   shapes: Mapping[str, tuple[int, ...]], split_inputs: set[str],
                   send_split: bool) -> tuple[fx.Graph, tuple[str, ...], tuple[bool, ...]]:
    """A stage's graph as one tp rank runs it, split along the sequence between its regions
    where the plan says so (``split_inputs`` arrive split; under ``send_split`` its split
    outputs leave so), the parameters whose gradients the tp group then sums, and which
    outputs leave split."""
    local = parallel_graph(fx.GraphModule(gm, stage_graph), regions, plan.tp,
                           EMITTED_COLLECTIVES, embeddings)
    if not plan.sequence_parallel:
        return local.graph, (), ()
    split = sequence_parallel_graph(local, shapes, plan.tp, EMITTED_COLLECTIVES,
                                    EMITTED_SEQUENCE, split_inputs, send_split)
    return split.graph_module.graph, split.summed, split.split_outputs


def _parts(specs: tuple[Boundary, ...], split: Sequence[bool], tp: int
           ) -> tuple[Boundary, ...]:
    """``specs`` with each value sent ``split`` as a rank's part: 1/tp of its sequence."""
    return tuple(replace(b, shape=(b.shape[0], b.shape[1] // tp, *b.shape[2:])) if part else b
                 for b, part in zip(specs, split, strict=True))


def _is_float(dtype: str) -> bool:
    return bool(getattr(torch, dtype).is_floating_point)


def tied_parameters(root: torch.nn.Module, codes: Sequence[StageCode]
                    ) -> tuple[tuple[tuple[int, str], ...], ...]:
    """Parameters that two or more stages keep (the same tensor object), with each stage's name
    for it; in the order of their first stage and name, so the output is deterministic."""
    holders: dict[int, dict[int, str]] = {}
    for code in codes:
        for path in code.module_paths:
            for name, parameter in _parameters_at(root, path):
                holders.setdefault(id(parameter), {}).setdefault(code.index, name)
    tied = [tuple(sorted(stages.items())) for stages in holders.values() if len(stages) > 1]
    return tuple(sorted(tied))


def _parameters_at(root: torch.nn.Module, path: str) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters a stage keeps at ``path`` (a submodule or an attribute), by name."""
    module_path, _, name = path.rpartition(".")
    value = getattr(root.get_submodule(module_path) if module_path else root, name)
    if isinstance(value, torch.nn.Parameter):
        return [(path, value)]
    if isinstance(value, torch.nn.Module):
        return [(f"{path}.{n}", p) for n, p in value.named_parameters(remove_duplicate=False)]
    return []


@dataclass(frozen=True)
class _Specs:
    graph: CostGraph
    plan: Plan
    roots: dict[str, str]  # value -> the value whose storage it may share (storage_roots)
    grad_from: dict[str, int]  # see _grad_by_mutation

    def of(self, names: Sequence[str], cut: int, sent: bool) -> tuple[Boundary, ...]:
        """Boundaries at cut ``cut`` and the micro-batch size. Under bf16 autocast a tensor
        sent between stages travels in the dtype the single-device autocast run gives it (a
        Linear's output in bf16, an fp32 residual stream in fp32): rounding it at the cuts only
        would make the numerics depend on the partition."""
        bf16 = sent and self.plan.request.training.precision == "bf16"
        return tuple(self._boundary(name, cut, bf16) for name in names)

    def _boundary(self, name: str, cut: int, bf16: bool) -> Boundary:
        value = self.graph.value(name)
        root = self.roots.get(name, name)
        requires_grad = value.requires_grad or self.grad_from.get(root, cut + 1) <= cut
        return Boundary(value.shape_at(self.plan.micro_batch),
                        value.autocast_dtype if bf16 else value.dtype, requires_grad)


def _grad_by_mutation(gm: fx.GraphModule, compute: list[fx.Node],
                      roots: dict[fx.Node, fx.Node], graph: CostGraph) -> dict[str, int]:
    """Storages that an in-place op makes require grad (``x.add_(w)`` with x data and w a
    weight's output), by root value (``roots``: storage_roots): the first cut after which every
    value on them requires grad, whatever annotate measured when it was made."""
    needs_grad = {v.name: v.requires_grad for v in graph.values}
    grad_from: dict[str, int] = {}
    for position, n in enumerate(compute):
        target = written(gm, n)
        if target is not None and needs_grad.get(n.name, False):
            grad_from.setdefault(roots.get(target, target).name, position + 1)
    return grad_from


def _model_outputs(gm: fx.GraphModule) -> tuple[str, ...]:
    """The names of the model's output tensors: the last stage's outputs."""
    output = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    values = output if isinstance(output, tuple | list) else (output,)
    if not all(isinstance(v, fx.Node) for v in values):
        raise TraceError("the model's forward must return a tensor or a tuple of tensors to be "
                         "pipelined; return the loss input and compute extras outside forward")
    return tuple(v.name for v in values)


def _stage_graph(gm: fx.GraphModule, nodes: list[fx.Node], inputs: list[str],
                 outputs: tuple[str, ...], copied: set[str], sizes: dict[str, str]
                 ) -> tuple[fx.Graph, tuple[str, ...], dict[str, str]]:
    """The stage's graph, the paths it keeps, and its nodes' names by the model graph's; each
    input in ``copied`` is cloned first, and the stage uses (and forwards) the clone; a size
    made by an earlier stage (``sizes``: export's dynamic batch) is read again from an input
    with that symbol in its shape."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    by_name = {n.name: n for n in gm.graph.nodes}
    placeholders = {name: graph.placeholder(name) for name in inputs}
    for name, placeholder in placeholders.items():
        env[by_name[name]] = (graph.call_method("clone", (placeholder,)) if name in copied
                              else placeholder)
    paths: list[str] = []
    for n in nodes:
        for arg in n.all_input_nodes:
            if arg.name in sizes and arg not in env:
                env[arg] = _read_size(graph, placeholders, by_name, sizes[arg.name])
            if arg.op == "get_attr" and arg not in env:
                env[arg] = graph.node_copy(arg, env.__getitem__)
                paths.append(str(arg.target))
        env[n] = graph.node_copy(n, env.__getitem__)
        if n.op == "call_module":
            paths.append(str(n.target))
    if outputs:
        values = [env[by_name[name]] for name in outputs]
        graph.output(values[0] if len(values) == 1 else tuple(values))
    else:
        output = next(n for n in gm.graph.nodes if n.op == "output")
        graph.output(fx.map_arg(output.args[0], env.__getitem__))
    return graph, _outermost(paths), {n.name: env[n].name for n in nodes}


def _read_size(graph: fx.Graph, placeholders: dict[str, fx.Node], by_name: dict[str, fx.Node],
               symbol: str) -> fx.Node:
    """``symbol`` read from the first input whose shape has it (liveness made sure one does)."""
    for name, placeholder in placeholders.items():
        for dim, size in enumerate(by_name[name].meta["val"].shape
                                   if symbol in shape_symbols(by_name[name]) else ()):
            if isinstance(size, torch.SymInt) and str(size.node.expr) == symbol:
                return graph.call_function(torch.ops.aten.sym_size.int, (placeholder, dim))
    raise AssertionError(f"no input of the stage has the size {symbol}")


def _stage_source(code: PythonCode, user_module: str) -> tuple[str, list[str]]:
    """fx's source for a stage, made standalone: (source, the import lines it needs)."""
    # fx re-registers wrapped functions for re-tracing; an emitted file does not retrace.
    source = "\n".join(line for line in code.src.splitlines()
                       if not line.strip().startswith("torch.fx._symbolic_trace.wrap("))
    # torch.export records the device it traced on (meta) in factory calls such as arange:
    # the stage creates those tensors where its inputs are instead.
    source = source.replace("device(type='meta')", "self.run_device")
    imports = []
    for name, value in sorted(code.globals.items()):
        # A global is used when its name is read: not as a keyword (`device = x`) or an
        # attribute (`x.device`).
        if name == "torch" or not re.search(rf"(?<![\w.]){re.escape(name)}\b(?!\s*=(?!=))",
                                            source):
            continue
        if module := _emitted_module(value, user_module):
            # The model file's functions as `user_model.f`, tensor_parallel.py's collectives as
            # `tensor_parallel.f`: a plain `f` could clash with fx's local variable of that name.
            alias = module.split()[-1]
            source = re.sub(rf"\b{re.escape(name)}\b", f"{alias}.{value.__name__}", source)
            imports.append(f"import {module}")
        elif line := _import_line(name, value):
            imports.append(line)
    return _tidy(source), imports


def _emitted_module(value: Any, user_module: str) -> str | None:
    """The output directory's module that defines ``value``, as stages.py imports it: the
    model file (model.py) or the tp collectives (tensor_parallel.py); None: neither."""
    if getattr(value, "__module__", None) == "tensor_parallel":
        return "tensor_parallel"
    module = inspect.getmodule(value)
    return "model as user_model" if module is not None and module.__name__ == user_module \
        else None


def _outermost(paths: list[str]) -> tuple[str, ...]:
    """Paths not inside another path of the list, in order (keeping ``a`` keeps ``a.b``)."""
    unique = list(dict.fromkeys(paths))
    return tuple(p for p in unique
                 if not any(p.startswith(q + ".") for q in unique if q != p))


def _tidy(source: str) -> str:
    """fx's code without its leading blank lines and trailing whitespace."""
    lines = [line.rstrip() for line in textwrap.dedent(source).strip("\n").splitlines()]
    return "\n".join(lines)


def _import_line(name: str, value: Any) -> str:
    """An import statement that binds ``name`` to ``value`` ("" for builtins)."""
    if getattr(builtins, name, None) is value:
        return ""
    if isinstance(value, ModuleType):
        return f"import {value.__name__}" + ("" if value.__name__ == name else f" as {name}")
    if isinstance(value, float) and (math.isinf(value) or math.isnan(value)):
        return f"from math import {name}"
    if value is type(None):
        return "NoneType = type(None)"
    module = inspect.getmodule(value)
    module_name = module.__name__ if module is not None else getattr(value, "__module__", "")
    qualname = getattr(value, "__qualname__", name)
    if not module_name or "." in qualname:
        raise TraceError(f"the traced graph calls {value!r}, which cannot be imported by name "
                         "from the emitted stages.py; define it at the top level of a module")
    return f"from {module_name} import {qualname}" + ("" if qualname == name else f" as {name}")
