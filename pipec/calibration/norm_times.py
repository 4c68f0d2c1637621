"""BatchNorm's own time, where a profile timed the GroupNorm a pipelined plan runs instead.

`--norm auto` profiles each BatchNorm as the GroupNorm that pipelined plans run, but a
data-parallel plan keeps BatchNorm (synchronized across its replicas), whose kernels differ (on
a 2-core AMD EPYC VM its forward takes 2.3× GroupNorm's at 8 × 32 × 128 × 128). Each BatchNorm
is timed both ways on its own, on its input's shape, at every profiled micro-batch size; the
difference is what a plan that keeps it pays beyond the profile (``Calibration.kept_norm``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

import torch
from torch.nn import functional as F

from pipec.calibration.timers import device_now
from pipec.cost.model import NodeTiming
from pipec.frontend.costgraph import CostGraph, NodeCost
from pipec.frontend.normalization import NormRewrite

Norm = Callable[[torch.Tensor], torch.Tensor]


def kept_norm_timings(graph: CostGraph, rewrites: tuple[NormRewrite, ...], sizes: list[int],
                      device: torch.device, repeats: int) -> tuple[NodeTiming, ...]:
    """Per BatchNorm node the profile timed as GroupNorm, BatchNorm's forward and backward
    seconds less GroupNorm's, at each of ``sizes``."""
    groups = {r.module: r.groups for r in rewrites if r.groups is not None}
    return tuple(_difference(node, groups[node.target], sizes, device, repeats)
                 for node in graph.nodes
                 if node.batch_norm_channels and node.target in groups and node.shape)


def _difference(node: NodeCost, groups: int, sizes: list[int], device: torch.device,
                repeats: int) -> NodeTiming:
    channels = node.batch_norm_channels
    weight = torch.ones(channels, device=device, requires_grad=True)
    bias = torch.zeros(channels, device=device, requires_grad=True)

    def batch_norm(x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, None, None, weight, bias, training=True)

    def group_norm(x: torch.Tensor) -> torch.Tensor:
        return F.group_norm(x, groups, weight, bias)

    forward, backward = [0.0] * len(sizes), [0.0] * len(sizes)
    for i, size in enumerate(sizes):
        shape = (size, *node.shape[1:])
        if math.prod(shape) == channels:
            continue  # one value per channel: BatchNorm cannot train on it, no plan keeps it
        x = torch.randn(shape, device=device, requires_grad=True)
        kept, grouped = _pass_s(batch_norm, x, repeats), _pass_s(group_norm, x, repeats)
        forward[i], backward[i] = kept[0] - grouped[0], kept[1] - grouped[1]
    return NodeTiming(node.name, node.target, tuple(sizes), tuple(forward), tuple(backward))


def _pass_s(norm: Norm, x: torch.Tensor, repeats: int) -> tuple[float, float]:
    """The median forward and backward seconds of ``norm`` on ``x``, after one to warm up."""
    gradient = torch.ones_like(x)
    forward, backward = [], []
    for _ in range(repeats + 1):
        started = device_now(x.device)
        y = norm(x)
        computed = device_now(x.device)
        y.backward(gradient)
        forward.append(computed - started)
        backward.append(device_now(x.device) - computed)
    return statistics.median(forward[1:]), statistics.median(backward[1:])
