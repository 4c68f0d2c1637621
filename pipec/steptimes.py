"""What a training step runs besides the model's nodes, timed for `pipec profile` and the
measured-by-default compile: the model file's loss on the model's real output (the last stage
runs it after its nodes), and its sample_batch (train.py makes each step's data with it)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from torch import fx, nn

from pipec.costmodel import NodeTiming
from pipec.loader import ModelSpec
from pipec.timers import device_now


def loss_timing(gm: nn.Module, inputs: dict[int, tuple[torch.Tensor, ...]],
                targets: dict[int, Any], loss_fn: Any, device: torch.device, repeats: int
                ) -> NodeTiming:
    """The model file's loss, forward and backward, on the model's real output at each size:
    what train.py's last stage runs after its nodes (the median of ``repeats`` + 1 runs)."""
    fwd, bwd = [], []
    for size, batch in inputs.items():
        with torch.no_grad():
            output = fx.node.map_aggregate(gm(*batch), _leaf)
        target = fx.node.map_aggregate(targets[size], _to(device))
        times = np.array([_loss_pass(loss_fn, output, target, device)
                          for _ in range(repeats + 1)])[1:]
        fwd.append(float(np.median(times[:, 0])))
        bwd.append(float(np.median(times[:, 1])))
    return NodeTiming("loss", "loss_fn", tuple(inputs), tuple(fwd), tuple(bwd))


def _leaf(value: Any) -> Any:
    return value.detach().requires_grad_(value.is_floating_point()) if isinstance(
        value, torch.Tensor) else value


def _to(device: torch.device) -> Any:
    return lambda value: value.to(device) if isinstance(value, torch.Tensor) else value


def _loss_pass(loss_fn: Any, output: Any, target: Any, device: torch.device
               ) -> tuple[float, float]:
    started = device_now(device)
    loss = loss_fn(output, target)
    backward_started = device_now(device)
    loss.backward()
    return backward_started - started, device_now(device) - backward_started



def data_seconds(spec: ModelSpec, sizes: list[int]) -> tuple[float, float]:
    """What train.py's synthetic data costs: sample_batch timed at each size (the median of 5)
    as train.py calls it, seeded for the step inside a forked random state (0.26 ms of the
    0.47 ms the MLP sample's batch of 64 took here, against 0.02 ms for sample_batch alone),
    fitted as fixed seconds + seconds per sample. A model file with train_dataset() reads its
    own data, which is not timed: (0, 0)."""
    if spec.has_train_dataset:
        return (0.0, 0.0)
    seconds = []
    for size in sizes:
        trials = []
        for step in range(5):
            started = time.perf_counter()
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(step)
                spec.sample_batch(size)
            trials.append(time.perf_counter() - started)
        seconds.append(float(np.median(trials)))
    if len(sizes) == 1:
        return (0.0, seconds[0] / sizes[0])
    per_sample, fixed = np.polyfit(sizes, seconds, 1)
    return (max(float(fixed), 0.0), max(float(per_sample), 0.0))
