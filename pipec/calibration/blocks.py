"""Measured by default for a model too large to build whole here: the graph timed span by span,
with only a span's weights made. A run of identical blocks (a transformer's layers: the nodes
of modules ``layers.0``, ``layers.1`` …, with the same operations) is timed once, on its first
block, and every block gets those times; what comes before the blocks (the embedding) and after
them (the head, the loss) is timed as a span each. A span's inputs are what the spans before it
computed: the first span gets sample_batch()'s, the one after the blocks the first block's
outputs in place of the last block's."""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import fx

from pipec.calibration.probe import side_by_side
from pipec.calibration.profile import (
    _one_pass,
    _samples,
    _time_in_context,
    _timings,
    fit_samples,
)
from pipec.calibration.split_backward_times import split_backward_timing
from pipec.calibration.step_times import data_seconds, loss_timing, optimizer_seconds
from pipec.cost.model import Calibration, NodeTiming
from pipec.frontend.costgraph import CostGraph, NodeCost
from pipec.frontend.loader import ModelSpec
from pipec.frontend.trace import Traced, batch_inputs, model_loss

log = logging.getLogger(__name__)

# "model.layers.3.mlp" -> ("model.layers", 3): the first numbered module on a node's path.
NUMBERED_MODULE = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


@dataclass(frozen=True)
class Blocks:
    """A run of adjacent identical blocks: block k's nodes are ``starts[k]`` onwards, ``length``
    of them, in the modules ``{container}.{index}``."""

    container: str
    starts: tuple[int, ...]
    length: int

    @property
    def end(self) -> int:
        return self.starts[-1] + self.length


def repeated_blocks(graph: CostGraph) -> Blocks | None:
    """The run of identical blocks that covers the most nodes (None: the graph has none): the
    nodes of each numbered module of one container, contiguous and adjacent, with the same
    operations, module paths (the number aside) and shapes."""
    spans: dict[str, dict[int, list[int]]] = {}
    for position, node in enumerate(graph.nodes):
        numbered = NUMBERED_MODULE.match(node.module)
        if numbered:
            spans.setdefault(numbered[1], {}).setdefault(int(numbered[2]), []).append(position)
    found = [_run(graph, container, blocks) for container, blocks in spans.items()]
    runs = [run for run in found if run is not None]
    return max(runs, key=lambda run: run.length * len(run.starts), default=None)


def _run(graph: CostGraph, container: str, blocks: dict[int, list[int]]) -> Blocks | None:
    positions = [blocks[index] for index in sorted(blocks)]
    length, first = len(positions[0]), positions[0][0]
    if len(positions) < 2 or any(p != list(range(first + k * length, first + (k + 1) * length))
                                 for k, p in enumerate(positions)):
        return None
    indices = sorted(blocks)
    reference = [_signature(graph.nodes[p], container, indices[0]) for p in positions[0]]
    for index, block in zip(indices[1:], positions[1:], strict=True):
        if [_signature(graph.nodes[p], container, index) for p in block] != reference:
            return None
    return Blocks(container, tuple(p[0] for p in positions), length)


def _signature(node: NodeCost, container: str, index: int) -> tuple[str, str, str, tuple[int, ...]]:
    own = f"{container}.{index}"
    return (node.op, node.target.replace(own, "#"), node.module.replace(own, "#", 1), node.shape)


@dataclass(frozen=True)
class Span:
    """Some of the graph's nodes as a module of their own: its inputs (the values from before
    it that it reads) and outputs (the values it makes that later nodes read), by node name."""

    module: fx.GraphModule
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


def span_of(gm: fx.GraphModule, names: list[str], last: bool = False) -> Span:
    """The nodes of ``gm`` named ``names`` (in graph order) as a GraphModule holding only the
    submodules and attributes they use (still on the meta device); the ``last`` span returns
    what the model returns."""
    by_name = {n.name: n for n in gm.graph.nodes}
    nodes = [by_name[name] for name in names]
    inside = set(nodes)
    inputs = list(dict.fromkeys(arg for n in nodes for arg in n.all_input_nodes
                                if arg not in inside and arg.op != "get_attr"))
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {arg: graph.placeholder(arg.name) for arg in inputs}
    for n in nodes:
        for arg in n.all_input_nodes:
            if arg.op == "get_attr" and arg not in env:
                env[arg] = graph.node_copy(arg, env.__getitem__)
        env[n] = graph.node_copy(n, env.__getitem__)
    outputs = [n for n in nodes if any(user not in inside for user in n.users)]
    if last:
        returned = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        graph.output(fx.map_arg(returned, env.__getitem__))
    else:
        graph.output(tuple(env[n] for n in outputs))
    return Span(fx.GraphModule(gm, graph), tuple(a.name for a in inputs),
                tuple(n.name for n in outputs))


def made_on(span: Span, device: torch.device) -> fx.GraphModule:
    """A copy of the span's module with its weights and buffers made on ``device``: random
    weights (times do not depend on their values), ones for integer and boolean buffers."""
    module = copy.deepcopy(span.module).to_empty(device=device)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.normal_(0.0, 0.02)
        for buffer in module.buffers():
            if buffer.is_floating_point():
                buffer.normal_(0.0, 0.02)
            else:
                buffer.fill_(1)
    return module.train()


@dataclass(frozen=True)
class SpanPlan:
    """What per-block measuring times: the spans before, of the first block and after."""

    blocks: Blocks
    spans: tuple[tuple[int, int], ...]  # (start, end) node positions: before, block, after


def measuring_plan(graph: CostGraph) -> SpanPlan | None:
    blocks = repeated_blocks(graph)
    if blocks is None:
        return None
    first = blocks.starts[0]
    # The last span returns the model's output, which the loss is timed on: where nothing
    # follows the blocks, the last block is that span, measured on its own.
    after = blocks.end if blocks.end < len(graph.nodes) else blocks.starts[-1]
    spans = ((0, first), (first, first + blocks.length), (after, len(graph.nodes)))
    return SpanPlan(blocks, spans)


def span_bytes(graph: CostGraph, span: tuple[int, int], micro_batch: int) -> float:
    """What timing one span holds at its peak: its weights, their gradients, its buffers and
    its nodes' saved activations."""
    nodes = graph.nodes[span[0]:span[1]]
    return (sum(2 * n.param_bytes + n.buffer_bytes + n.saved_bytes.at(micro_batch)
                for n in nodes) + sum(n.output_bytes.at(micro_batch) for n in nodes[-1:]))


def profile_by_blocks(spec: ModelSpec, traced: Traced, graph: CostGraph, plan: SpanPlan,
                      sizes: list[int], device: torch.device, repeats: int, bf16: bool,
                      min_seconds: float, processes: int) -> Calibration:
    """The model's times per node, measured span by span (``plan``) at ``sizes``."""
    names = [n.name for n in graph.nodes]
    spans = [span_of(traced.graph_module, names[start:end], last=k == len(plan.spans) - 1)
             for k, (start, end) in enumerate(plan.spans)]
    modules = [made_on(span, device) for span in spans]
    inputs = _span_inputs(spec, traced, graph, plan, spans, modules, sizes, device)
    seconds = {size: np.zeros((2, len(names))) for size in sizes}
    overhead = (0.0, 0.0)
    for (start, end), module, span_inputs in zip(plan.spans, modules, inputs, strict=True):
        if start == end:
            continue
        timed, fixed = _time_in_context(module, span_inputs, repeats, device, bf16, min_seconds)
        for size in sizes:
            for block_start in ((start,) if start != plan.blocks.starts[0]
                                else plan.blocks.starts):
                seconds[size][:, block_start:block_start + end - start] = timed[size]
        overhead = fixed if start == plan.blocks.starts[0] else overhead
    samples = [s for size in sizes for s in _samples(graph, size, seconds[size])]
    forward, backward = fit_samples(samples)
    block, block_inputs = modules[1], inputs[1]
    middle = sizes[len(sizes) // 2]
    contention = side_by_side(lambda: _one_pass(block, block_inputs[middle], device), processes)
    last = len(plan.spans) - 1
    loss = loss_timing(modules[last], inputs[last], _targets(spec, sizes),
                       model_loss(spec, traced), device, repeats)
    return Calibration(
        device.type, forward, backward, _timings(graph, samples), overhead,
        contention=contention, data_s=data_seconds(spec, sizes), loss=loss,
        split_backward=_all_blocks(split_backward_timing(block, block_inputs, device),
                                   len(plan.blocks.starts)),
        optimizer_s=optimizer_seconds(block))


def _all_blocks(one: NodeTiming, count: int) -> NodeTiming:
    """One block's split-backward cost for ``count`` blocks (what comes before and after the
    blocks is not counted)."""
    return NodeTiming(one.node, one.target, one.sizes, one.fwd_s,
                      tuple(count * s for s in one.bwd_s))


def _targets(spec: ModelSpec, sizes: list[int]) -> dict[int, Any]:
    return {size: batch_inputs(spec, size)[1] for size in sizes}


def _span_inputs(spec: ModelSpec, traced: Traced, graph: CostGraph, plan: SpanPlan,
                 spans: list[Span], modules: list[fx.GraphModule], sizes: list[int],
                 device: torch.device) -> list[dict[int, tuple[Any, ...]]]:
    """Each span's inputs at each size: the model's inputs and what the spans before it
    computed, the first block's values standing in for the other blocks'."""
    stand_in = _block_names(graph, plan)
    inputs: list[dict[int, tuple[Any, ...]]] = [{} for _ in spans]
    for size in sizes:
        placeholders = [n.name for n in traced.graph_module.graph.nodes if n.op == "placeholder"]
        values: dict[str, Any] = dict(zip(placeholders, _on(batch_inputs(spec, size)[0],
                                                            device), strict=False))
        for k, (span, module) in enumerate(zip(spans, modules, strict=True)):
            arguments = tuple(_leaf(values[stand_in.get(name, name)]) for name in span.inputs)
            inputs[k][size] = arguments
            if k < len(spans) - 1:
                with torch.no_grad():
                    values.update(zip(span.outputs, module(*arguments), strict=True))
    return inputs


def _block_names(graph: CostGraph, plan: SpanPlan) -> dict[str, str]:
    """Each node of the blocks after the first by the name of the first block's node at its
    place (the last span reads the last block's outputs, or the one's before it)."""
    first, length = plan.blocks.starts[0], plan.blocks.length
    return {graph.nodes[start + k].name: graph.nodes[first + k].name
            for start in plan.blocks.starts[1:] for k in range(length)}


def _on(tensors: tuple[torch.Tensor, ...], device: torch.device) -> Iterator[torch.Tensor]:
    return (t.to(device) for t in tensors)


def _leaf(value: Any) -> Any:
    """A span's input as a stage receives it: a float tensor that requires grad."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().requires_grad_(True)
    return value


def fitting_sizes(graph: CostGraph, plan: SpanPlan, sizes: list[int], free: float) -> list[int]:
    """The sizes at which every span fits in ``free`` bytes."""
    return [size for size in sizes
            if max(span_bytes(graph, span, size) for span in plan.spans) <= free]


__all__ = [
    "Blocks",
    "Span",
    "SpanPlan",
    "fitting_sizes",
    "measuring_plan",
    "profile_by_blocks",
    "repeated_blocks",
    "span_of",
]
