"""Sharded data parallelism (``--fsdp``): FSDP2's ``fully_shard`` over each stage's replicas, in
place of DDP, one FSDP unit per stage (docs/planner.md, "Sharded data parallelism").

What torch 2.13's pipeline runtime does with an FSDP stage decides both terms. Every backward of
a step but the last runs with ``set_reshard_after_backward(False)`` and
``set_requires_gradient_sync(False)`` (``PipelineStage.backward_maybe_with_nosync``), and the
gradients are reduce-scattered once, after the step's last backward (``perform_reduce_grad``).
So from the first backward to the step's end a stage holds its whole unsharded weights and
their unsharded fp32 gradients, whichever mode; what stays sharded at the peak is the sharded
copy of the weights and the optimizer state (÷ dp).

- ``zero2`` (``reshard_after_forward=False``): one all-gather of the stage's weights per step
  (its first forward) and one reduce-scatter of its gradients.
- ``zero3`` (``reshard_after_forward=True``): every forward frees the gathered weights again,
  so the backward that follows gathers them again: about one all-gather per micro-batch, and
  one more. Its peak is zero2's (the backward gathers them all and keeps them), so ``auto``
  searches zero2 only.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from pipec.cost.hardware import Device
from pipec.cost.model import (
    AUTOCAST_COPY_RATIO,
    GRADIENT_RATIO,
    OPTIMIZER_STATE_RATIO,
    NodeArrays,
    Training,
    allreduce_s,
    static_ratio,
)

FSDP_MODES = ("auto", "off", "zero2", "zero3")
SHARDED = ("zero2", "zero3")
# Host memory FSDP2 holds per process besides the terms above (its parameters' DTensor state,
# hooks and the code they run): a device's own on a CPU. On a 2-core AMD EPYC VM, over stacks of
# 4 and 32 Linear layers of 16 KiB: 1.3 and 1.5 MiB more than DDP at the same step.
HOST_BYTES = 1.4 * 2**20


def sharded_static_ratio(training: Training, replicas: int) -> float:
    """Bytes kept per fp32 parameter byte at an FSDP stage's peak: the unsharded weight and
    gradient, the sharded weight and optimizer state (÷ replicas), and autocast's bf16 copy of
    each unsharded weight (a leaf parameter: autocast caches its cast until the step ends)."""
    sharded = (1.0 + OPTIMIZER_STATE_RATIO[training.optimizer]) / replicas
    return 1.0 + GRADIENT_RATIO + sharded + AUTOCAST_COPY_RATIO[training.precision]


def shard_arrays(arrays: NodeArrays, weight_bytes: np.ndarray, training: Training,
                 replicas: int) -> NodeArrays:
    """``arrays`` with each node's static bytes as an FSDP stage over ``replicas`` holds them
    (``weight_bytes``: per node, its parameters' fp32 bytes, shared ones included)."""
    saved = static_ratio(training) - sharded_static_ratio(training, replicas)
    return replace(arrays, static_bytes=arrays.static_bytes - weight_bytes * saved)


def all_gathers(mode: str, micro_batches: int) -> int:
    """All-gathers of a stage's weights per step (see the module's docstring)."""
    return 1 if mode == "zero2" else micro_batches + 1


def collectives_s(mode: str, weight_bytes: float, micro_batches: int, replicas: int,
                  device: Device, inter_node: bool) -> float:
    """One step's all-gathers and reduce-scatter of ``weight_bytes`` (fp32): each is half a
    ring all-reduce, (d − 1) steps moving (d − 1)/d of the bytes (Patarasuk & Yuan 2009)."""
    half = allreduce_s(weight_bytes, replicas, device, inter_node) / 2
    return (all_gathers(mode, micro_batches) + 1) * half


def collective_count(mode: str, micro_batches: int) -> int:
    """The collectives a step waits on: the all-gathers, the reduce-scatter, the loss's."""
    return all_gathers(mode, micro_batches) + 2
