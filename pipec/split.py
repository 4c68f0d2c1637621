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
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from torch import fx

from pipec.annotate import COMPUTE_OPS, live_values
from pipec.errors import TraceError
from pipec.planner import Plan
from pipec.trace import Traced


@dataclass(frozen=True)
class StageCode:
    index: int
    class_name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]  # empty for the last stage, which returns the model's output
    module_paths: tuple[str, ...]  # submodules and attributes the stage keeps
    forward_source: str  # ``def forward(self, ...)`` and its body, unindented


@dataclass(frozen=True)
class Staged:
    stages: tuple[StageCode, ...]
    imports: tuple[str, ...]  # import lines the generated code needs


def split(traced: Traced, plan: Plan, user_module: str) -> Staged:
    gm = traced.graph_module
    compute = [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]
    live = live_values(gm)
    codes: list[StageCode] = []
    imports: dict[str, None] = {}
    for stage in plan.stages:
        last = stage.index == len(plan.stages) - 1
        outputs = () if last else tuple(live[stage.end])
        graph, paths = _stage_graph(gm, compute[stage.start:stage.end], live[stage.start],
                                    outputs)
        code = graph.python_code(root_module="self")
        used = {name: value for name, value in code.globals.items()
                if name != "torch" and re.search(rf"\b{re.escape(name)}\b", code.src)}
        imports.update(dict.fromkeys(_import_lines(used, user_module)))
        codes.append(StageCode(stage.index, f"Stage{stage.index}", tuple(live[stage.start]),
                               outputs, paths, _tidy(code.src)))
    return Staged(tuple(codes), tuple(sorted(imports)))


def _stage_graph(gm: fx.GraphModule, nodes: list[fx.Node], inputs: list[str],
                 outputs: tuple[str, ...]) -> tuple[fx.Graph, tuple[str, ...]]:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    by_name = {n.name: n for n in gm.graph.nodes}
    for name in inputs:
        env[by_name[name]] = graph.placeholder(name)
    paths: list[str] = []
    for n in nodes:
        for arg in n.all_input_nodes:
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
    return graph, _outermost(paths)


def _outermost(paths: list[str]) -> tuple[str, ...]:
    """Paths not inside another path of the list, in order (keeping ``a`` keeps ``a.b``)."""
    unique = list(dict.fromkeys(paths))
    return tuple(p for p in unique
                 if not any(p.startswith(q + ".") for q in unique if q != p))


def _tidy(source: str) -> str:
    """fx's code without its leading blank lines and trailing whitespace."""
    lines = [line.rstrip() for line in textwrap.dedent(source).strip("\n").splitlines()]
    return "\n".join(lines)


def _import_lines(names: dict[str, Any], user_module: str) -> list[str]:
    """Import statements that bind every global name the generated code uses."""
    return [line for name, value in sorted(names.items())
            if (line := _import_line(name, value, user_module))]


def _import_line(name: str, value: Any, user_module: str) -> str:
    if getattr(builtins, name, None) is value:
        return ""
    if isinstance(value, ModuleType):
        return f"import {value.__name__}" + ("" if value.__name__ == name else f" as {name}")
    if isinstance(value, float) and (math.isinf(value) or math.isnan(value)):
        return f"from math import {name}"
    if value is type(None):
        return "NoneType = type(None)"
    module = inspect.getmodule(value)
    module_name = "model" if module is not None and module.__name__ == user_module else (
        module.__name__ if module is not None else getattr(value, "__module__", ""))
    qualname = getattr(value, "__qualname__", name)
    if not module_name or "." in qualname:
        raise TraceError(f"the traced graph calls {value!r}, which cannot be imported by name "
                         "from the emitted stages.py; define it at the top level of a module")
    return f"from {module_name} import {qualname}" + ("" if qualname == name else f" as {name}")
