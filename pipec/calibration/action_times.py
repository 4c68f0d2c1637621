"""The pipelining runtime's own time, measured on this machine's processes for
pipec.calibration.probe (CPU) and pipec.calibration.gpu_probe (a GPU each): per forward or
backward action, per step of each schedule, and what splitting a backward or recomputing
selectively adds per autograd operation."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipec.calibration.timers import median_in_turns, median_s, synchronized
from pipec.torchcompat import pipeline_backward, runtime_compat

MICRO_BATCHES = 16
SCHEDULE_MICRO_BATCHES = 8
CPU = torch.device("cpu")


def action_overhead_s(rank: int, device: torch.device = CPU) -> float:
    """The pipelining runtime's own seconds per action, on ranks 0 and 1 (others: nan). On a
    GPU, the host's seconds: what the runtime adds between two actions' kernel launches."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    group = dist.new_group([0, 1])
    if rank > 1:
        return float("nan")
    torch.manual_seed(0)
    layer = nn.Linear(4, 4, device=device)
    stage = PipelineStage(layer, rank, 2, device, group=group)
    runtime_compat().prepare_stage(stage)
    schedule = ScheduleGPipe(stage, MICRO_BATCHES, loss_fn=lambda out, target: out.sum())
    busy = [0.0]
    for name in ("forward_one_chunk", "backward_one_chunk"):
        setattr(stage, name, _timed(getattr(stage, name), busy))
    inputs = torch.ones(MICRO_BATCHES, 4, device=device)
    for step in range(6):
        busy[0] = 0.0 if step == 1 else busy[0]  # the first step warms up
        schedule.step(*((inputs,) if rank == 0 else ()),
                      target=inputs if rank == 1 else None)
    per_action = busy[0] / (5 * 2 * MICRO_BATCHES)
    return max(per_action - _plain_action_s(layer), 0.0)


SCHEDULE_ROUNDS = 48


def schedule_steps(rank: int, device: torch.device = CPU) -> dict[str, float]:
    """Per schedule, the median step of a 4-wide linear layer per stage on ranks 0 and 1
    (others: empty), stages placed as the schedule places them. The schedules take turns, over
    SCHEDULE_ROUNDS rounds, so that the machine's drift lands on all alike: one step of 1F1B
    varies fourfold (5.6 to 22 ms on a 2-core AMD EPYC VM)."""
    from pipec.planning.schedules import SCHEDULES

    group = dist.new_group([0, 1])
    steps: dict[str, float] = {}
    if rank <= 1:
        runs = {schedule: synchronized(_pipeline_step(schedule, rank, group, device), device)
                for schedule in SCHEDULES}
        steps = median_in_turns(runs, SCHEDULE_ROUNDS)
    # The other ranks wait here, holding no core: their next probes, computing beside these
    # steps, would slow them.
    dist.barrier()
    return steps


def _pipeline_step(schedule: str, rank: int, group: Any, device: torch.device
                   ) -> Callable[[], None]:
    """One step of ``schedule``'s 2-device pipeline on this rank, ready to run."""
    from torch.distributed import pipelining

    from pipec.planning.schedules import SCHEDULE_CLASSES, stage_device

    virtual = 1 if schedule in ("gpipe", "1f1b") else 2
    indices = [k for k in range(2 * virtual) if stage_device(schedule, k, 2) == rank]
    torch.manual_seed(0)
    stages = [pipelining.PipelineStage(nn.Linear(4, 4, device=device), k, 2 * virtual, device,
                                       group=group) for k in indices]
    for stage in stages:
        runtime_compat().prepare_stage(stage)
    runner = getattr(pipelining, SCHEDULE_CLASSES[schedule])(
        stages if virtual > 1 else stages[0], SCHEDULE_MICRO_BATCHES,
        loss_fn=lambda out, target: out.sum())
    inputs = torch.ones(SCHEDULE_MICRO_BATCHES, 4, device=device)
    last = stage_device(schedule, 2 * virtual - 1, 2) == rank

    def step() -> None:
        dist.barrier(group=group)
        runner.step(*((inputs,) if rank == 0 else ()), target=inputs if last else None)

    return step


def split_backward_node_s() -> float:
    """Seconds per autograd operation that splitting a backward into the input's and the
    weights' gradients adds (torch's own functions, as the zero-bubble schedules call them)."""
    from pipec.frontend.node_costs import autograd_nodes

    torch.manual_seed(0)
    model = nn.Sequential(*(layer for _ in range(16) for layer in (nn.Linear(16, 16), nn.ReLU())))

    def backward(split: bool) -> Callable[[], None]:
        def run() -> None:
            x = torch.ones(8, 16, requires_grad=True)
            out = model(x)
            pipeline_backward([out], [torch.ones_like(out)], [x], model.parameters(), split)
        return run

    extra = median_s(backward(True), 20) - median_s(backward(False), 20)
    nodes = autograd_nodes(model(torch.ones(8, 16, requires_grad=True)))
    return max(extra, 0.0) / nodes


def selective_node_s() -> float:
    """Seconds per autograd operation that selective recomputation adds, each time it runs
    (forward, then recomputing): its dispatch mode sees every operation in Python. A chain of
    cheap operations it keeps none of, checkpointed selectively and in full: the same
    operations run, twice each."""
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts,
    )

    from pipec.frontend.node_costs import autograd_nodes

    def chain(x: torch.Tensor) -> torch.Tensor:
        for _ in range(32):
            x = torch.tanh(x) * 1.01
        return x

    def recompute(*_: Any, **__: Any) -> CheckpointPolicy:
        return CheckpointPolicy.PREFER_RECOMPUTE

    def run(selective: bool) -> Callable[[], None]:
        context = functools.partial(create_selective_checkpoint_contexts, recompute)

        def step() -> None:
            x = torch.ones(8, 16, requires_grad=True)
            if selective:
                out = checkpoint(chain, x, use_reentrant=False, context_fn=context)
            else:
                out = checkpoint(chain, x, use_reentrant=False)
            out.sum().backward()
        return step

    extra = median_s(run(True), 20) - median_s(run(False), 20)
    nodes = autograd_nodes(chain(torch.ones(8, 16, requires_grad=True)))
    return max(extra, 0.0) / (2 * nodes)


def _timed(method: Callable[..., Any], busy: list[float]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        result = method(*args, **kwargs)
        busy[0] += time.perf_counter() - started
        return result
    return call


def _plain_action_s(layer: nn.Module) -> float:
    """The layer's own forward and backward of one micro-batch, per action."""
    x = torch.ones(1, 4, device=next(layer.parameters()).device, requires_grad=True)

    def forward_backward() -> None:
        layer(x).sum().backward()

    return median_s(forward_backward, 50) / 2
