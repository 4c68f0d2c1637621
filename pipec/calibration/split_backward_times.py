"""What a zero-bubble schedule's split backward costs a model beyond its whole backward.

torch's zero-bubble schedules run a stage's backward in two calls (stage_backward_input, then
stage_backward_weight): the input's gradient first, keeping the graph, then the weights'. The
calls walk the autograd graph in Python, and the second runs part of some nodes' backward
again, which a fixed cost per autograd operation (the runtime probe's) misses. So compile
measures each model: its backward whole and split, at the smallest and the largest profiled
size, after the profile's passes (a heap that has warmed up: in a fresh one the split's extra
blocks are faulted in too). On a 2-core AMD EPYC VM it adds 4.8 and 41 ms to the U-Net at
micro-batches 1 and 16. The graph is cut at its first floating-point value, which takes the
gradient a stage's input would.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
from torch import fx, nn

from pipec.calibration.timers import device_now
from pipec.cost.model import NodeTiming
from pipec.frontend.tensors import flat_tensors
from pipec.torchcompat import pipeline_backward

SPLIT_REPEATS = 5  # backward pairs per size, after one to warm up


def split_backward_timing(gm: fx.GraphModule, inputs: dict[int, tuple[torch.Tensor, ...]],
                          device: torch.device) -> NodeTiming:
    """What splitting ``gm``'s backward adds (``bwd_s``; ``fwd_s`` 0) at the smallest and the
    largest of the sizes in ``inputs``: every plan's micro-batch lies between, where the
    timing interpolates. Extrapolating instead overestimates: from sizes 1 and 8, the deep
    MLP's reaches 18 ms at micro-batch 64, where it measures 2.7–3.9 ms (a 2-core AMD EPYC
    VM)."""
    sizes = sorted(inputs)
    measured = sorted({sizes[0], sizes[-1]})
    extra = tuple(_extra_s(gm, inputs[size], device) for size in measured)
    return NodeTiming("split_backward", "", tuple(measured), (0.0,) * len(measured), extra)


def _extra_s(gm: fx.GraphModule, inputs: tuple[torch.Tensor, ...], device: torch.device
             ) -> float:
    whole, split = [], []
    for _ in range(SPLIT_REPEATS + 1):  # alternating: a drifting machine drifts under both
        whole.append(_backward_s(gm, inputs, device, split=False))
        split.append(_backward_s(gm, inputs, device, split=True))
    return max(statistics.median(split[1:]) - statistics.median(whole[1:]), 0.0)


def _backward_s(gm: fx.GraphModule, inputs: tuple[torch.Tensor, ...], device: torch.device,
                split: bool) -> float:
    cut = _CutAtFirstFloat(gm)
    # Copies, as a zero-bubble stage sends (stages.py's COPY_OUTPUTS): torch's split backward
    # detaches the outputs in place, which a view (a model's reshaped logits) refuses.
    outputs = [t.clone() for t in flat_tensors(cut.run(*inputs)) if t.requires_grad]
    gradients = [torch.ones_like(t) for t in outputs]
    weights = _reached_parameters(outputs) if split else []
    started = device_now(device)
    if split and cut.value is not None:
        pipeline_backward(outputs, gradients, [cut.value], weights, split=True)
    elif outputs:
        torch.autograd.backward(outputs, gradients)
    ended = device_now(device)
    gm.zero_grad(set_to_none=True)
    return ended - started


def _reached_parameters(outputs: list[torch.Tensor]) -> list[nn.Parameter]:
    """The parameters the outputs' backward reaches: those after the cut, as a stage holds
    them (torch 2.11's split backward refuses any other: "appears to not have been used in
    the graph"; the embedding before a language model's first float value is one)."""
    found: dict[int, nn.Parameter] = {}
    seen: set[Any] = set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        function = stack.pop()
        if function is None or function in seen:
            continue
        seen.add(function)
        variable = getattr(function, "variable", None)  # an AccumulateGrad's leaf
        if isinstance(variable, nn.Parameter):
            found[id(variable)] = variable
        stack.extend(following for following, _ in function.next_functions)
    return list(found.values())


class _CutAtFirstFloat(fx.Interpreter):
    """Runs the graph with its first floating-point activation detached and asking for its
    gradient: what a pipeline stage's received input is."""

    def __init__(self, gm: nn.Module) -> None:
        super().__init__(gm)
        self.value: torch.Tensor | None = None

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        # An activation, as a stage receives: not a weight (an exported graph reads weights
        # through get_attr nodes, GPT-2's token embedding first).
        if self.value is None and n.op not in ("get_attr", "placeholder") \
                and isinstance(result, torch.Tensor) and result.is_floating_point():
            result = result.detach().requires_grad_(True)
            self.value = result
        return result
