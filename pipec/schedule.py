"""Simulate a pipeline schedule: iteration time, bubble, in-flight micro-batches, timeline.

Each stage runs its actions in the schedule's order; an action starts when its stage is free and
its input is ready (the previous stage's forward, the next stage's backward). Orders follow
torch.distributed.pipelining: GPipe runs every forward, then every backward; 1F1B (PipeDream-Flush)
runs ``num_stages - stage_index - 1`` warm-up forwards, then alternates, then drains.
"""

from __future__ import annotations

from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class Action:
    stage: int
    micro_batch: int
    kind: str  # "F" or "B"
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Simulation:
    iteration_s: float
    bubble: float  # fraction of device time spent idle
    in_flight: tuple[int, ...]  # most micro-batches whose activations each stage holds at once
    actions: tuple[Action, ...]


def runs(schedule: str, num_stages: int, num_micro_batches: int) -> bool:
    """Whether torch.distributed.pipelining runs the schedule: 1F1B needs M ≥ num_stages."""
    return schedule == "gpipe" or num_micro_batches >= num_stages


def in_flight(schedule: str, num_stages: int, num_micro_batches: int) -> tuple[int, ...]:
    """Micro-batches each stage holds activations for at its peak."""
    if schedule == "gpipe":
        return (num_micro_batches,) * num_stages
    return tuple(min(num_stages - s, num_micro_batches) for s in range(num_stages))


def action_order(schedule: str, stage: int, num_stages: int, num_micro_batches: int
                 ) -> list[tuple[str, int]]:
    """The (kind, micro-batch) sequence one stage runs."""
    forwards = [("F", k) for k in range(num_micro_batches)]
    backwards = [("B", k) for k in range(num_micro_batches)]
    if schedule == "gpipe":
        return forwards + backwards
    warmup = min(num_stages - stage - 1, num_micro_batches)
    order = forwards[:warmup]
    for k in range(num_micro_batches - warmup):
        order += [forwards[warmup + k], backwards[k]]
    return order + backwards[num_micro_batches - warmup:]


def simulate(schedule: str, fwd_s: list[float], bwd_s: list[float],
             num_micro_batches: int) -> Simulation:
    """Run the schedule on stages whose forward and backward take ``fwd_s[s]`` and ``bwd_s[s]``."""
    stages = len(fwd_s)
    orders = [action_order(schedule, s, stages, num_micro_batches) for s in range(stages)]
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * stages
    position = [0] * stages
    actions: list[Action] = []
    while any(position[s] < len(orders[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while position[s] < len(orders[s]):
                kind, k = orders[s][position[s]]
                ready = _ready(done, kind, s, k, stages)
                if ready is None:
                    break
                start = max(free[s], ready)
                end = start + (fwd_s[s] if kind == "F" else bwd_s[s])
                done[(kind, s, k)] = free[s] = end
                actions.append(Action(s, k, kind, start, end))
                position[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {schedule} deadlocks")  # a bug in action_order
    iteration = max(free)
    busy = num_micro_batches * (sum(fwd_s) + sum(bwd_s))
    bubble = 1 - busy / (stages * iteration) if iteration > 0 else 0.0
    return Simulation(iteration, bubble, in_flight(schedule, stages, num_micro_batches),
                      tuple(sorted(actions, key=lambda a: (a.stage, a.start_s))))


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
