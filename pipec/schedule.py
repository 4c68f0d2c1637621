"""Simulate a pipeline schedule: iteration time, bubble, in-flight micro-batches, timeline.

Glossary: a *device* (pipeline position) runs one stage, or ``v`` stages under the interleaved
schedule: stage k sits on device k mod pp. Each device runs its actions in the schedule's order;
an action starts when its device is free and its input is ready (the previous stage's forward,
the next stage's backward). Orders follow torch.distributed.pipelining: GPipe runs every
forward, then every backward; 1F1B (PipeDream-Flush) runs ``pp - device - 1`` warm-up forwards,
then alternates, then drains; interleaved 1F1B (Narayanan et al. 2021, torch's
ScheduleInterleaved1F1B) warms up ``(v - 1)·pp + 2(pp - device - 1)`` forwards, depth first,
then alternates.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b", "interleaved")

Order = list[tuple[str, int, int]]  # (kind "F" or "B", stage, micro-batch)


@dataclass(frozen=True)
class Action:
    stage: int
    micro_batch: int
    kind: str  # "F" or "B"
    start_s: float
    end_s: float
    device: int = 0  # pipeline position that runs the stage


@dataclass(frozen=True)
class Simulation:
    iteration_s: float
    bubble: float  # fraction of device time spent idle
    in_flight: tuple[int, ...]  # per stage, most micro-batches whose activations it holds at once
    actions: tuple[Action, ...]
    devices: int = 0  # pipeline positions (rows of the timeline)


def runs(schedule: str, pp: int, num_micro_batches: int, virtual: int = 1) -> bool:
    """Whether torch.distributed.pipelining runs the schedule: 1F1B needs M ≥ pp; interleaved
    needs two or more devices and stages per device, and M a multiple of pp."""
    if schedule == "gpipe":
        return virtual == 1
    if schedule == "1f1b":
        return virtual == 1 and num_micro_batches >= pp
    return (pp >= 2 and virtual >= 2 and num_micro_batches >= pp
            and num_micro_batches % pp == 0)


def action_order(schedule: str, device: int, pp: int, num_micro_batches: int,
                 virtual: int = 1) -> Order:
    """The (kind, stage, micro-batch) sequence one device runs."""
    if schedule == "interleaved":
        return _interleaved_order(device, pp, num_micro_batches, virtual)
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
    """Per stage, the most micro-batches whose forward ran and whose backward has not."""
    peak = [0] * (pp * virtual)
    for device in range(pp):
        held = [0] * (pp * virtual)
        for kind, stage, _ in action_order(schedule, device, pp, num_micro_batches, virtual):
            held[stage] += 1 if kind == "F" else -1
            peak[stage] = max(peak[stage], held[stage])
    return tuple(peak)


def simulate(schedule: str, fwd_s: list[float], bwd_s: list[float], num_micro_batches: int,
             pp: int | None = None) -> Simulation:
    """Run the schedule on stages whose forward and backward take ``fwd_s[k]`` and ``bwd_s[k]``;
    ``pp`` devices (default: one per stage) each run ``len(fwd_s) / pp`` stages."""
    stages = len(fwd_s)
    pp = pp or stages
    virtual = stages // pp
    orders = [action_order(schedule, d, pp, num_micro_batches, virtual) for d in range(pp)]
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * pp
    position = [0] * pp
    actions: list[Action] = []
    while any(position[d] < len(orders[d]) for d in range(pp)):
        progressed = False
        for d in range(pp):
            while position[d] < len(orders[d]):
                kind, s, k = orders[d][position[d]]
                ready = _ready(done, kind, s, k, stages)
                if ready is None:
                    break
                start = max(free[d], ready)
                end = start + (fwd_s[s] if kind == "F" else bwd_s[s])
                done[(kind, s, k)] = free[d] = end
                actions.append(Action(s, k, kind, start, end, d))
                position[d] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {schedule} deadlocks")  # a bug in action_order
    iteration = max(free)
    busy = num_micro_batches * (sum(fwd_s) + sum(bwd_s))
    bubble = 1 - busy / (pp * iteration) if iteration > 0 else 0.0
    return Simulation(iteration, bubble, in_flight(schedule, pp, num_micro_batches, virtual),
                      tuple(sorted(actions, key=lambda a: (a.device, a.start_s))), pp)


def _ready(done: dict[tuple[str, int, int], float], kind: str, stage: int, k: int,
           stages: int) -> float | None:
    """When the inputs of an action are available, or None if they are not computed yet."""
    if kind == "F":
        return 0.0 if stage == 0 else done.get(("F", stage - 1, k))
    own = done.get(("F", stage, k))
    if stage == stages - 1 or own is None:
        return own
    upstream = done.get(("B", stage + 1, k))
    return None if upstream is None else max(own, upstream)
