"""The zero-bubble schedules torch.distributed.pipelining ships (Qi et al. 2024, "Zero Bubble
Pipeline Parallelism"): each backward split into the input's gradient ("I", which the previous
stage waits for) and the weights' ("W", which waits for nobody and fills the bubbles).

- ``interleaved-zb`` (torch's ScheduleInterleavedZeroBubble, the paper's ZB-1P over v stages per
  device, stage k on device k mod pp): warms up ``(v - 1)·pp + (pp - device - 1)`` forwards,
  then runs a forward and an input gradient per step, device d holding back its weight
  gradients d steps, and drains.
- ``zbv`` (ScheduleZBVZeroBubble, the paper's ZB-V): two stages per device in a V, device d
  holding stages d and 2·pp − 1 − d, so the last stage sits on device 0 beside the first.

Each order is one device's (kind, stage, micro-batch) sequence, as torch computes it.
"""

from __future__ import annotations

import collections

Order = list[tuple[str, int, int]]


class _Counter:
    """Numbers each stage's actions of one kind in the order they are placed."""

    def __init__(self) -> None:
        self.counts: collections.Counter[tuple[str, int]] = collections.Counter()

    def take(self, kind: str, stage: int) -> tuple[str, int, int]:
        self.counts[kind, stage] += 1
        return (kind, stage, self.counts[kind, stage] - 1)


def interleaved_zb_order(device: int, pp: int, num_micro_batches: int, virtual: int) -> Order:
    """torch's ScheduleInterleavedZeroBubble for one device (M a multiple of pp: rounds of pp
    micro-batches)."""
    per_round, total = pp, virtual * num_micro_batches
    warmup = min((virtual - 1) * per_round + (pp - 1 - device), total)
    counter, order = _Counter(), []

    def forward_stage(op: int) -> int:
        return (op // per_round) % virtual * pp + device

    def backward_stage(op: int) -> int:
        return (virtual - 1 - ((op - warmup) // per_round) % virtual) * pp + device

    order += [counter.take("F", forward_stage(op)) for op in range(warmup)]
    backwards: list[int] = []  # the ops whose input gradient ran, in order
    weights = 0
    for op in range(warmup, total + warmup):
        if op < total:
            order.append(counter.take("F", forward_stage(op)))
        order.append(counter.take("I", backward_stage(op)))
        backwards.append(op)
        if op - warmup >= device:  # device d holds back its weight gradients d steps
            order.append(counter.take("W", backward_stage(backwards[weights])))
            weights += 1
    order += [counter.take("W", backward_stage(op)) for op in backwards[weights:]]
    return order


def zbv_order(device: int, pp: int, num_micro_batches: int) -> Order:
    """torch's ScheduleZBVZeroBubble for one device: it plans for at least 2·pp − 1
    micro-batches and leaves out the actions of those the step does not have."""
    planned = max(2 * pp - 1, num_micro_batches)
    first, second = device, 2 * pp - 1 - device  # the V's two arms
    counter, order = _Counter(), []
    forwards = {first: 0, second: 0}

    def forward(stage: int) -> tuple[str, int, int]:
        forwards[stage] += 1
        return counter.take("F", stage)

    def backward(stage: int, weight: bool = True) -> list[tuple[str, int, int]]:
        return [counter.take("I", stage)] + ([counter.take("W", stage)] if weight else [])

    order += [forward(first) for _ in range(2 * (pp - device) - 1)]
    for _ in range(device):
        order += [forward(second), forward(first)]
    for _ in range(pp - device):
        order += [forward(second), *backward(second)]
    while forwards[second] < forwards[first] or forwards[first] < planned:
        if forwards[first] < planned:
            order.append(forward(first))
        order += backward(first)
        order += [forward(second), *backward(second)]
    for _ in range(device):
        order += [*backward(first, weight=False), *backward(second, weight=False)]
    for _ in range(pp - device):
        order += backward(first)
    order += _remaining_weights(counter, second) + _remaining_weights(counter, first)
    return [a for a in order if a[2] < num_micro_batches]


def _remaining_weights(counter: _Counter, stage: int) -> Order:
    """The weight gradients of ``stage`` whose input gradient ran and they did not yet."""
    missing = counter.counts["I", stage] - counter.counts["W", stage]
    return [counter.take("W", stage) for _ in range(missing)]


def v_device(stage: int, pp: int) -> int:
    """The device of ``stage`` when two stages per device form a V (zbv)."""
    return stage if stage < pp else 2 * pp - 1 - stage
