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
  does not search it.
- ``block``: FSDP as torchtitan applies it. Each block (the modules under a path's first
  number, ``layers.3``) is a unit of its own, gathered for its forward and again for its
  backward and freed after each, in bf16 under ``--precision bf16`` (``MixedPrecisionPolicy``,
  gradients reduced in fp32); the rest of the stage is one more unit, gathered while the stage
  holds micro-batches. The emitted stage hides the FSDP module from the pipeline runtime, so
  each backward reduce-scatters its gradients into the sharded ones at once: at the peak a
  device holds every weight, gradient and optimizer state sharded, the non-block weights whole,
  and one block's gathered weights and gradients (twice over: FSDP gathers the next block while
  one computes). The price: two all-gathers and one reduce-scatter per block and micro-batch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
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

FSDP_MODES = ("auto", "off", "zero2", "zero3", "block")
SHARDED = ("zero2", "zero3", "block")
BLOCK = "block"
# Per byte of a block's fp32 weights, what FSDP holds of the block it computes and the one it
# gathers meanwhile (two gathered copies) and of the block's unsharded gradient; under bf16 each
# copy is half as large, and the gradient is cast to fp32 for the reduce-scatter.
GATHERED_COPIES = 2
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


def gathered_ratio(training: Training) -> float:
    """Bytes of a gathered weight per fp32 byte: bf16 gathers under --precision bf16."""
    return 0.5 if training.precision == "bf16" else 1.0


def outside_block_ratio(training: Training) -> float:
    """Bytes per fp32 byte of a weight outside the blocks that a ``block`` stage holds whole
    besides its shards: the gathered weight (the stage's unit, gathered from its forward to its
    backward's end) and its unsharded gradient through the backward, cast to fp32 for the
    reduce-scatter under bf16."""
    gathered = gathered_ratio(training)
    return 2 * gathered + (1.0 if gathered < 1.0 else 0.0)


def block_static_ratio(training: Training, replicas: int) -> float:
    """Bytes kept per fp32 parameter byte of a block unit at a ``block`` stage's peak: its
    weight, gradient and optimizer state, all sharded (÷ replicas)."""
    return (1.0 + GRADIENT_RATIO + OPTIMIZER_STATE_RATIO[training.optimizer]) / replicas


def unit_working_ratio(training: Training) -> float:
    """Bytes per fp32 byte of the largest block that a ``block`` stage holds while it computes
    (see GATHERED_COPIES): gathered weights twice, the unsharded gradient, and its fp32 cast."""
    gathered = gathered_ratio(training)
    return GATHERED_COPIES * gathered + gathered + (1.0 if gathered < 1.0 else 0.0)


def shard_arrays(arrays: NodeArrays, weight_bytes: np.ndarray, training: Training,
                 replicas: int, mode: str, in_block: np.ndarray) -> NodeArrays:
    """``arrays`` with each node's static bytes as an FSDP stage over ``replicas`` holds them
    (``weight_bytes``: per node, its parameters' fp32 bytes, shared ones included); under
    ``block``, a node ``in_block`` keeps its weights sharded only, the others gathered too, with
    their gradient (outside_block_ratio)."""
    if mode == BLOCK:
        kept = (block_static_ratio(training, replicas)
                + np.where(in_block, 0.0, outside_block_ratio(training)))
    else:
        kept = np.full(len(weight_bytes), sharded_static_ratio(training, replicas))
    return replace(arrays, static_bytes=arrays.static_bytes
                   - weight_bytes * (static_ratio(training) - kept))


def fsdp_unit(module: str) -> str:
    """The ``block`` unit of a module: its path up to its first number (``layers.3`` for
    ``layers.3.mlp.up``), or "" (the stage's own unit) where the path has none."""
    parts = module.split(".") if module else []
    numbered = next((i for i, part in enumerate(parts) if part.isdigit()), None)
    return "" if numbered is None else ".".join(parts[:numbered + 1])


def block_units(calls: Sequence[str]) -> dict[str, str]:
    """Per called module (``calls``: the call_module targets, in order, of modules holding
    parameters), its ``block`` unit; a block any of whose modules runs more than once per
    forward stays in the stage's unit (FSDP gathers a unit once per forward)."""
    repeated = {fsdp_unit(c) for c, n in Counter(calls).items() if n > 1}
    return {c: fsdp_unit(c) for c in calls if fsdp_unit(c) not in repeated | {""}}


def all_gathers(mode: str, micro_batches: int, recomputing: bool = False) -> int:
    """All-gathers of each unit's weights per step (see the module's docstring); under
    ``block`` a recomputing stage's forward runs again in its backward, gathering each block a
    third time."""
    per_micro_batch = 3 if recomputing else 2
    return {"zero2": 1, "zero3": micro_batches + 1}.get(mode, per_micro_batch * micro_batches)


def reduce_scatters(mode: str, micro_batches: int) -> int:
    """Reduce-scatters of each unit's gradients per step."""
    return micro_batches if mode == BLOCK else 1


def collectives_s(mode: str, weight_bytes: float, micro_batches: int, replicas: int,
                  device: Device, inter_node: bool, gathered: float = 1.0,
                  recomputing: bool = False) -> float:
    """One step's all-gathers (``gathered`` bytes per fp32 byte) and reduce-scatters (fp32) of
    ``weight_bytes``: each is half a ring all-reduce, (d − 1) steps moving (d − 1)/d of the
    bytes (Patarasuk & Yuan 2009)."""
    half = allreduce_s(weight_bytes, replicas, device, inter_node) / 2
    return (all_gathers(mode, micro_batches, recomputing) * gathered
            + reduce_scatters(mode, micro_batches)) * half


def collective_count(mode: str, micro_batches: int, units: int = 1,
                     recomputing: bool = False) -> int:
    """The collectives a step waits on: each unit's all-gathers and reduce-scatters, and the
    loss's."""
    return units * (all_gathers(mode, micro_batches, recomputing)
                    + reduce_scatters(mode, micro_batches)) + 1
