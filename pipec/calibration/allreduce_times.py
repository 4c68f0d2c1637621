"""The probe's data-parallel measurements (pipec.calibration.probe runs them on every process):
the all-reduce by itself, at a step's end (DistributedDataParallel's buckets, the loss) and in
the middle of a pass (a synchronized BatchNorm's statistics and gradient sums).

A blocking all-reduce in a pass waits for the slowest replica, and the replicas' compute drifts
apart between two waits: pipec.calibration.runtime_fit.blocking_fit fits latency + drift ·
√compute through the two sizes measured here (on a 2-core AMD EPYC VM, 1.9 ms per all-reduce
with 0.5 ms of compute between two, 3.8 ms with 12.5 ms).

A pipeline's replicas all-reduce in groups smaller than the machine's processes (pp × dp: dp
replicas per position), and the all-reduce on a step's critical path is the one its first
position runs last, while the other positions' processes wait for the next step. A smaller
group's all-reduce costs less than one over every process, so the probe measures each smaller
group too (``group_data_parallel_s``), the others waiting.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipec.calibration.timers import mean_s, median_s, synchronized

ALLREDUCE_BYTES = 4 * 1024 * 1024
CPU = torch.device("cpu")
# The data-parallel probe's models, (width, linear layers), 32 samples: gradients of 16 KiB
# and 4 MiB in 8 tensors, then 14 KiB in 96. DDP's reducer does work for every gradient tensor
# (its autograd hook marks each one ready): on a 2-core AMD EPYC VM, 96 tensors of 14 KiB cost
# 1.3 ms a step more than 8 tensors of 16 KiB, with the same two all-reduces.
DATA_PARALLEL_SHAPES = ((32, 4), (512, 4), (8, 48))
# The blocking probe: BLOCKING_BLOCKS conv → BatchNorm → ReLU blocks of 16 channels on 8 images
# of each side, an all-reduce of a BatchNorm's statistics after each block, forward and back.
BLOCKING_SIDES = (16, 64)
BLOCKING_BLOCKS = 4
BLOCKING_CHANNELS = 16


def allreduce_s(device: torch.device = CPU, size: int = ALLREDUCE_BYTES) -> float:
    """The median seconds of an all-reduce of ``size`` bytes over every process."""
    tensor = torch.zeros(size // 4, device=device)
    return median_s(synchronized(lambda: dist.all_reduce(tensor), device), 8)


def step_s(device: torch.device = CPU) -> float:
    """The median seconds of an all-reduce of one value (train.py shares the loss each step)."""
    value = torch.zeros(1, device=device)
    return median_s(synchronized(lambda: dist.all_reduce(value), device), 20)


def data_parallel_bytes(width: int, layers: int) -> int:
    """The gradient bytes of the data-parallel probe's model of ``layers`` of ``width``."""
    return layers * (width * width + width) * 4


def data_parallel_tensors(layers: int) -> int:
    """The gradient tensors of the data-parallel probe's model: a weight and a bias a layer."""
    return 2 * layers


def replica_counts(processes: int) -> list[int]:
    """The data-parallel groups smaller than ``processes`` that a pp × dp layout of them has:
    every dp of 2 or more dividing it, but itself."""
    return [d for d in range(2, processes) if processes % d == 0]


def group_data_parallel_s(rank: int, replicas: int) -> list[tuple[float, float]]:
    """The data-parallel steps (DATA_PARALLEL_SHAPES) on ranks 0 … ``replicas`` − 1 while the
    others wait in a barrier, holding no core ([] on those; every rank calls it)."""
    group = dist.new_group(list(range(replicas)))
    steps = ([data_parallel_s(*shape, group=group) for shape in DATA_PARALLEL_SHAPES]
             if rank < replicas else [])
    dist.barrier()
    return steps


def data_parallel_s(width: int, layers: int, group: Any = None) -> tuple[float, float]:
    """A training step of ``layers`` linear layers of ``width``, and what
    DistributedDataParallel and the loss's all-reduce over ``group`` (default: every process)
    add to it (the medians of three rounds, each alternating the two)."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    plain = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
    replicated = DistributedDataParallel(plain, gradient_as_bucket_view=True,
                                         process_group=group)
    x = torch.ones(32, width)

    def step(model: nn.Module, synchronized: bool) -> Callable[[], None]:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)

        def run() -> None:
            optimizer.zero_grad(set_to_none=True)
            loss = model(x).square().mean()
            loss.backward()
            if synchronized:
                dist.all_reduce(loss.detach(), group=group)
            optimizer.step()
        return run

    return _timed_s(step(plain, False), step(replicated, True), 20, group)


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


def _timed_s(plain: Callable[[], None], synchronized: Callable[[], None], repeats: int,
             group: Any = None) -> tuple[float, float]:
    """A step of ``plain``, and what ``synchronized`` takes beyond it: the medians over three
    rounds, each timing both, the mean of ``repeats`` steps each (the waits come in rare long
    ones); ``group``'s processes start each together."""
    alone, extra = [], []
    for _ in range(3):
        dist.barrier(group=group)
        alone.append(mean_s(plain, repeats))
        dist.barrier(group=group)
        extra.append(mean_s(synchronized, repeats) - alone[-1])
    return statistics.median(alone), max(statistics.median(extra), 0.0)
