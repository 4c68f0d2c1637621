"""Pipeline schedules: each device's order of actions, and the micro-batches each stage holds.

Glossary: a *device* (pipeline position) runs one stage, or ``v`` stages under the interleaved
schedule: stage k sits on device k mod pp. Each device runs its actions in the schedule's order
(pipec.planning.simulate times them). Orders follow torch.distributed.pipelining: GPipe runs every
forward, then every backward; 1F1B (PipeDream-Flush) runs ``pp - device - 1`` warm-up forwards,
then alternates, then drains; interleaved 1F1B (Narayanan et al. 2021, torch's
ScheduleInterleaved1F1B) warms up ``(v - 1)·pp + 2(pp - device - 1)`` forwards, depth first,
then alternates. The zero-bubble schedules (pipec.planning.zero_bubble) split each backward into the
input's gradient ("I") and the weights' ("W").
"""

from __future__ import annotations

import functools
import itertools

import numpy as np

from pipec.planning.zero_bubble import interleaved_zb_order, v_device, zbv_order

SCHEDULES = ("gpipe", "1f1b", "interleaved", "interleaved-zb", "zbv")
# torch.distributed.pipelining's class for each.
SCHEDULE_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                    "interleaved": "ScheduleInterleaved1F1B",
                    "interleaved-zb": "ScheduleInterleavedZeroBubble",
                    "zbv": "ScheduleZBVZeroBubble"}
# Schedules whose torch runtime (_PipelineScheduleRuntime) waits for its sends only at the end
# of the step: the tensors sent stay alive until then (stage_memory.StageRole.holds_sends).
# ScheduleGPipe and Schedule1F1B wait for each send within the step.
HOLDS_SENDS = frozenset({"interleaved", "interleaved-zb", "zbv"})
# Schedules that split each backward into the input's gradient and the weights'.
ZERO_BUBBLE = frozenset({"interleaved-zb", "zbv"})

# (kind, stage, micro-batch); kind "F" forward, "B" backward, or, split, "I" the input's
# gradient and "W" the weights'.
Order = list[tuple[str, int, int]]


def runs(schedule: str, pp: int, num_micro_batches: int, virtual: int = 1) -> bool:
    """Whether torch.distributed.pipelining runs the schedule: 1F1B needs M ≥ pp; interleaved
    (either) needs two or more devices and stages per device, and M a multiple of pp; ZB-V two
    or more devices with exactly two stages each."""
    if schedule == "gpipe":
        return virtual == 1
    if schedule == "1f1b":
        return virtual == 1 and num_micro_batches >= pp
    if schedule == "zbv":
        return pp >= 2 and virtual == 2
    return (pp >= 2 and virtual >= 2 and num_micro_batches >= pp
            and num_micro_batches % pp == 0)


def stage_device(schedule: str, stage: int, pp: int) -> int:
    """The pipeline device that runs ``stage``: k mod pp (a loop), or ZB-V's V."""
    return v_device(stage, pp) if schedule == "zbv" else stage % pp


def posted_links(devices: list[int]) -> list[int]:
    """Per stage (stage k runs on ``devices[k]``), how many of its boundaries cross to another
    device: the sends and receives its forward posts, and its backward (0 where a neighbour
    shares its device: torch hands the tensor over in place)."""
    crossing = [a != b for a, b in itertools.pairwise(devices)]
    return [int(k > 0 and crossing[k - 1]) + int(k < len(crossing) and crossing[k])
            for k in range(len(devices))]


def action_order(schedule: str, device: int, pp: int, num_micro_batches: int,
                 virtual: int = 1) -> Order:
    """The (kind, stage, micro-batch) sequence one device runs."""
    if schedule == "interleaved":
        return _interleaved_order(device, pp, num_micro_batches, virtual)
    if schedule == "interleaved-zb":
        return interleaved_zb_order(device, pp, num_micro_batches, virtual)
    if schedule == "zbv":
        return zbv_order(device, pp, num_micro_batches)
    forwards = [("F", device, k) for k in range(num_micro_batches)]
    backwards = [("B", device, k) for k in range(num_micro_batches)]
    if schedule == "gpipe":
        return forwards + backwards
    warmup = min(pp - device - 1, num_micro_batches)
    order = forwards[:warmup]
    for k in range(num_micro_batches - warmup):
        order += [forwards[warmup + k], backwards[k]]
    return order + backwards[num_micro_batches - warmup:]


def _interleaved_order(device: int, pp: int, num_micro_batches: int, virtual: int) -> Order:
    """torch's rule: rounds of pp micro-batches; forwards sweep the device's stages in rounds,
    backwards sweep them in reverse, each stage counting its own micro-batches."""
    per_round = pp  # M is a multiple of pp: M / pp rounds of pp micro-batches
    total = virtual * num_micro_batches
    warmup = min((virtual - 1) * per_round + 2 * (pp - device - 1), total)
    forward_count: dict[int, int] = {}
    backward_count: dict[int, int] = {}

    def take(kind: str, stage: int, counts: dict[int, int]) -> tuple[str, int, int]:
        counts[stage] = counts.get(stage, 0) + 1
        return (kind, stage, counts[stage] - 1)

    def forward(op: int) -> tuple[str, int, int]:
        return take("F", (op // per_round) % virtual * pp + device, forward_count)

    def backward(op: int) -> tuple[str, int, int]:
        local = virtual - 1 - ((op - warmup) // per_round) % virtual
        return take("B", local * pp + device, backward_count)

    order = [forward(op) for op in range(warmup)]
    for op in range(warmup, total):
        order += [forward(op), backward(op)]
    return order + [backward(op) for op in range(total, total + warmup)]


def in_flight(schedule: str, pp: int, num_micro_batches: int, virtual: int = 1
              ) -> tuple[int, ...]:
    """Per stage, the most micro-batches whose forward ran and whose backward has not (under a
    zero-bubble schedule, whose weights' gradient has not: until then the stage keeps what
    that gradient needs)."""
    if schedule == "gpipe":
        return (num_micro_batches,) * pp
    if schedule == "1f1b":
        return tuple(min(pp - s, num_micro_batches) for s in range(pp))
    if schedule in ZERO_BUBBLE:
        return _counted_in_flight(schedule, pp, num_micro_batches, virtual)
    return _interleaved_in_flight(pp, num_micro_batches, virtual)


@functools.lru_cache(maxsize=256)
def _counted_in_flight(schedule: str, pp: int, num_micro_batches: int, virtual: int
                       ) -> tuple[int, ...]:
    """Counted over each device's order: a forward adds one, a full or a weights' backward
    takes one away (vectorized per stage: M·v can be large)."""
    return _most_per_stage(schedule, pp, num_micro_batches, virtual, held=True)


def _most_per_stage(schedule: str, pp: int, num_micro_batches: int, virtual: int, held: bool
                    ) -> tuple[int, ...]:
    """Per stage, the most micro-batches it holds (``held``) or that await their weights'
    gradient, counted over its device's order."""
    most = [0] * (pp * virtual)
    for stages, holds, awaits in order_changes(schedule, pp, num_micro_batches, virtual):
        change = holds if held else awaits
        for stage in np.unique(stages):
            most[stage] = int(np.cumsum(change[stages == stage]).max(initial=0))
    return tuple(most)


# What an action does to the micro-batches a stage holds.
HELD_CHANGE = {"F": 1, "B": -1, "I": 0, "W": -1}
# What it does to those whose input gradient ran and whose weights' gradient has not.
AWAITING_CHANGE = {"F": 0, "B": 0, "I": 1, "W": -1}


Changes = tuple[np.ndarray, np.ndarray, np.ndarray]


@functools.lru_cache(maxsize=64)
def order_changes(schedule: str, pp: int, num_micro_batches: int, virtual: int
                  ) -> tuple[Changes, ...]:
    """Each device's order as read-only arrays: each action's stage, and what it changes in
    the micro-batches that stage holds and in those awaiting their weights' gradient."""
    if schedule == "interleaved":  # vectorized: M·v can be large
        return tuple(_interleaved_changes(device, pp, num_micro_batches, virtual)
                     for device in range(pp))
    return tuple(_changes(action_order(schedule, device, pp, num_micro_batches, virtual))
                 for device in range(pp))


def _interleaved_changes(device: int, pp: int, num_micro_batches: int, virtual: int
                         ) -> Changes:
    events = _interleaved_events(device, pp, num_micro_batches, virtual)
    arrays = ((events % virtual) * pp + device, np.where(events < virtual, 1, -1),
              np.zeros_like(events))
    for array in arrays:
        array.setflags(write=False)
    return arrays


def _changes(order: Order) -> Changes:
    arrays = (np.fromiter((stage for _, stage, _ in order), int, len(order)),
              np.fromiter((HELD_CHANGE[kind] for kind, _, _ in order), int, len(order)),
              np.fromiter((AWAITING_CHANGE[kind] for kind, _, _ in order), int, len(order)))
    for array in arrays:
        array.setflags(write=False)
    return arrays


@functools.lru_cache(maxsize=256)
def awaiting_weights(schedule: str, pp: int, num_micro_batches: int, virtual: int = 1
                     ) -> tuple[int, ...]:
    """Per stage, the most micro-batches whose input gradient ran and whose weights' gradient
    has not: each keeps the gradients its weights' pass needs. Zero outside the zero-bubble
    schedules. Not always at the moment the stage holds the most in flight, so a stage's own
    peak counted from both is an upper bound; a device's (pipec.planning.device_peak) is tighter."""
    if schedule not in ZERO_BUBBLE:
        return (0,) * (pp * virtual)
    return _most_per_stage(schedule, pp, num_micro_batches, virtual, held=False)


@functools.lru_cache(maxsize=256)
def _interleaved_in_flight(pp: int, num_micro_batches: int, virtual: int) -> tuple[int, ...]:
    """Counted over the events of _interleaved_order (vectorized: M·v can be large)."""
    peaks = [0] * (pp * virtual)
    for device in range(pp):
        events = _interleaved_events(device, pp, num_micro_batches, virtual)
        for local in range(virtual):
            held = np.cumsum((events == local).astype(int) - (events == local + virtual))
            peaks[local * pp + device] = int(held.max())
    return tuple(peaks)


def _interleaved_events(device: int, pp: int, num_micro_batches: int, virtual: int
                        ) -> np.ndarray:
    """_interleaved_order as its device's local stage per action: l for a forward of local
    stage l, virtual + l for a backward."""
    total = virtual * num_micro_batches
    warmup = min((virtual - 1) * pp + 2 * (pp - device - 1), total)
    ops = np.arange(total)
    forward = (ops // pp) % virtual
    backward = virtual - 1 - ((np.arange(warmup, total + warmup) - warmup) // pp) % virtual
    # Events in order: warm-up forwards, then F(op) B(op) pairs, then cool-down backwards.
    steady = np.stack([forward[warmup:], backward[:total - warmup] + virtual], axis=1)
    return np.concatenate([forward[:warmup], steady.ravel(), backward[total - warmup:] + virtual])
