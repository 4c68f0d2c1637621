"""The probe's data-parallel measurements (pipec.probe runs them on every process): the
all-reduce by itself, at a step's end (DistributedDataParallel's buckets, the loss) and in the
middle of a pass (a synchronized BatchNorm's statistics and gradient sums).

A blocking all-reduce in a pass waits for the slowest replica. Measured on the 2-core
development CPU, each one that a conv → BatchNorm → ReLU block runs forward and backward adds
1.9 ms to a step with 0.5 ms of compute between two of them, and 3.8 ms with 12.5 ms: beyond
the all-reduce's own 0.5 ms back to back, the replicas' compute drifts apart between two waits
(pipec.measured fits latency + drift · √compute through the two sizes measured here).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipec.timers import mean_s, median_s

ALLREDUCE_BYTES = 4 * 1024 * 1024
# The data-parallel probe's models, (width, linear layers), 32 samples: gradients of 16 KiB
# and 4 MiB in 8 tensors, then 14 KiB in 96. DDP's reducer does work for every gradient tensor
# (its autograd hook marks each one ready): measured here, 96 tensors of 14 KiB cost 1.3 ms a
# step more than 8 tensors of 16 KiB, with the same two all-reduces.
DATA_PARALLEL_SHAPES = ((32, 4), (512, 4), (8, 48))
# The blocking probe: BLOCKING_BLOCKS conv → BatchNorm → ReLU blocks of 16 channels on 8 images
# of each side, an all-reduce of a BatchNorm's statistics after each block, forward and back.
BLOCKING_SIDES = (16, 64)
BLOCKING_BLOCKS = 4
BLOCKING_CHANNELS = 16


def allreduce_s() -> float:
    tensor = torch.zeros(ALLREDUCE_BYTES // 4)
    return median_s(lambda: dist.all_reduce(tensor), 8)


def step_s() -> float:
    value = torch.zeros(1)
    return median_s(lambda: dist.all_reduce(value), 20)


def data_parallel_bytes(width: int, layers: int) -> int:
    """The gradient bytes of the data-parallel probe's model of ``layers`` of ``width``."""
    return layers * (width * width + width) * 4


def data_parallel_tensors(layers: int) -> int:
    """The gradient tensors of the data-parallel probe's model: a weight and a bias a layer."""
    return 2 * layers


def data_parallel_s(width: int, layers: int) -> tuple[float, float]:
    """A training step of ``layers`` linear layers of ``width``, and what
    DistributedDataParallel and the loss's all-reduce add to it (the medians of three rounds,
    each alternating the two)."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    plain = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
    replicated = DistributedDataParallel(plain, gradient_as_bucket_view=True)
    x = torch.ones(32, width)

    def step(model: nn.Module, synchronized: bool) -> Callable[[], None]:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)

        def run() -> None:
            optimizer.zero_grad(set_to_none=True)
            loss = model(x).square().mean()
            loss.backward()
            if synchronized:
                dist.all_reduce(loss.detach())
            optimizer.step()
        return run

    return _timed_s(step(plain, False), step(replicated, True), 20)


def blocking_s() -> list[tuple[float, float]]:
    """Per BLOCKING_SIDES, the compute between two blocking all-reduces of the blocking probe
    and the seconds each adds to its step, both per all-reduce."""
    return [_blocking_s(side) for side in BLOCKING_SIDES]


def _blocking_s(side: int) -> tuple[float, float]:
    torch.manual_seed(0)
    x = torch.randn(8, BLOCKING_CHANNELS, side, side)
    plain, blocking = _conv_blocks(synchronized=False), _conv_blocks(synchronized=True)

    def step(model: nn.Module) -> Callable[[], None]:
        return lambda: model(x).sum().backward()

    collectives = 2 * BLOCKING_BLOCKS
    compute, extra = _timed_s(step(plain), step(blocking), 10)
    return compute / collectives, extra / collectives


def _conv_blocks(synchronized: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(BLOCKING_BLOCKS):
        layers += [nn.Conv2d(BLOCKING_CHANNELS, BLOCKING_CHANNELS, 3, padding=1, bias=False),
                   nn.BatchNorm2d(BLOCKING_CHANNELS), nn.ReLU()]
        if synchronized:
            layers.append(_AllReduceOnTheWay())
    return nn.Sequential(*layers)


class _AllReduceOnTheWay(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _BlockingAllReduce.apply(x)


class _BlockingAllReduce(torch.autograd.Function):
    """The identity, all-reducing a BatchNorm's statistics on the way forward (its mean,
    variance and squared mean per channel and its count, float64) and its gradient sums on the
    way back: where a synchronized BatchNorm waits for the other replicas."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(torch.zeros(3 * BLOCKING_CHANNELS + 1, dtype=torch.float64))
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(torch.zeros(2 * BLOCKING_CHANNELS, dtype=torch.float64))
        return gradient


def _timed_s(plain: Callable[[], None], synchronized: Callable[[], None], repeats: int
             ) -> tuple[float, float]:
    """A step of ``plain``, and what ``synchronized`` takes beyond it: the medians over three
    rounds, each timing both, the mean of ``repeats`` steps each (the waits come in rare long
    ones)."""
    alone, extra = [], []
    for _ in range(3):
        dist.barrier()
        alone.append(mean_s(plain, repeats))
        dist.barrier()
        extra.append(mean_s(synchronized, repeats) - alone[-1])
    return statistics.median(alone), max(statistics.median(extra), 0.0)
