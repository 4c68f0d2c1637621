"""Simulate a pipeline schedule (pipec.planning.schedules's orders): iteration time, bubble,
in-flight micro-batches, timeline; and the bounds no partition beats.

Each device runs its actions in its order; an action starts when its device is free and its
inputs are ready (the previous stage's forward, the next stage's backward).

A *late receive*: torch posts an action's receive just before the action, and gloo's transfer is
a rendezvous (the sender's thread writes once the receiver has asked), so an input sent before
its receiver was free arrives ``late_receive_s`` after the receiver asks for it: on CPU processes
sharing cores, the wait for the busy sender's thread to wake (pipec.calibration.receive_times).
"""

from __future__ import annotations

import collections
import functools
import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipec.cost.cores import SharedCores, Steps, shared_times
from pipec.planning.schedules import ZERO_BUBBLE, action_order, in_flight, stage_device


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


def lower_bound_s(work_s: float, pp: int, num_micro_batches: int, virtual: int = 1,
                  schedule: str = "1f1b", chain_s: float = 0.0) -> float:
    """No partition of ``work_s`` (one micro-batch's forward + backward over all stages) runs
    faster under these schedules.

    One micro-batch's forward and backward chain through every stage: at least ``work_s`` (under
    a zero-bubble schedule ``chain_s``: the weights' gradients leave the chain); some device
    does 1/pp of the M micro-batches' work. With one stage per device, stage s starts no
    earlier than the forwards of the stages before it and ends no earlier than their backwards
    after its own M: ``T ≥ P_s + M·t_s`` with P_s the work before s. The stage times that
    minimize the largest of these make them all equal: t_s = (T/M)(1 − 1/M)^s, so
    ``T ≥ W / (1 − (1 − 1/M)^pp)`` (on balanced stages the closed form is (M + pp − 1)·W/pp).
    """
    if schedule in ZERO_BUBBLE:  # weights' gradients leave the chain: ``chain_s`` is the rest
        return max(chain_s, num_micro_batches * work_s / pp)
    busiest = max(work_s, num_micro_batches * work_s / pp)
    if virtual > 1:
        return busiest
    return max(busiest, work_s / (1 - (1 - 1 / num_micro_batches) ** pp))


def stage_lower_bound_s(fwd_s: list[float], bwd_s: list[float], num_micro_batches: int,
                        pp: int, schedule: str = "1f1b") -> float:
    """A bound for known stage times: device d's first action is stage d's first forward, so it
    finishes no earlier than ``F_d + M·T_d`` (F_d: the forwards of stages 0…d−1 of one
    micro-batch; T_d: the device's work per micro-batch). Unless the schedule defers weight
    gradients (zero-bubble), its last action is stage d's last backward, which the backwards of
    stages d−1…0 follow: ``P_d + M·T_d`` with P_d their forward and backward. On balanced
    stages that is each schedule's closed form, e.g. (vM + pp − 1)·W/(v·pp) for interleaved
    1F1B."""
    work = [f + b for f, b in zip(fwd_s, bwd_s, strict=True)]
    zero_bubble = schedule in ZERO_BUBBLE
    before = fwd_s if zero_bubble else work
    prefix = list(itertools.accumulate(before[:pp - 1], initial=0.0))
    per_device = [0.0] * pp
    for stage, w in enumerate(work):
        per_device[stage_device(schedule, stage, pp)] += w
    # One micro-batch's chain through every stage, weights' gradients off it when deferred.
    chain = sum(fwd_s) if zero_bubble else sum(work)
    return max(chain, *(prefix[d] + num_micro_batches * per_device[d] for d in range(pp)))


def simulate(schedule: str, fwd_s: list[float], bwd_s: list[float], num_micro_batches: int,
             pp: int | None = None, timeline: bool = True,
             weight_s: list[float] | None = None, cores: SharedCores | None = None,
             late_receive_s: float = 0.0,
             transfer_s: tuple[Sequence[float], Sequence[float]] | None = None) -> Simulation:
    """Run the schedule on stages whose forward and backward take ``fwd_s[k]`` and ``bwd_s[k]``;
    ``pp`` devices (default: one per stage) each run ``len(fwd_s) / pp`` stages. Under a
    zero-bubble schedule ``weight_s[k]`` of the backward is the weights' gradient (default:
    half). ``timeline``: keep every action (for the picture), else only the figures. ``cores``:
    the devices are processes sharing a CPU's cores, faster while others wait (pipec.cost.cores).
    ``late_receive_s``: what an input from another device costs when it was sent before its
    receiver was free (the module's docstring). ``transfer_s``: per stage, the time on the link
    of what its forward and its backward send, from the send (or that late post) to the
    arrival; none by default (a stage's times then hold its sends)."""
    stages = len(fwd_s)
    pp = pp or stages
    structure = _structure(schedule, pp, num_micro_batches, stages // pp)
    weights = weight_s if weight_s is not None else [b / 2 for b in bwd_s]
    inputs = [b - w for b, w in zip(bwd_s, weights, strict=True)]
    each = _per_step(structure, [*fwd_s, *bwd_s, *weights, *inputs])
    links = _link_s(structure, transfer_s)
    if cores is not None and cores.shared:
        start, end = shared_times(structure.steps, each, pp, cores, late_receive_s, links)
    else:
        start, end = _plain_times(structure, each, pp, late_receive_s, links)
    iteration = max(end, default=0.0)
    busy = sum(end) - sum(start)
    bubble = 1 - busy / (pp * iteration) if iteration > 0 else 0.0
    actions = tuple(sorted((Action(s, k, kind, start[i], end[i], d)
                            for i, (kind, s, k, d) in enumerate(zip(
                                structure.kinds, structure.stages, structure.micro_batches,
                                structure.devices, strict=True))),
                           key=lambda a: (a.device, a.start_s))) if timeline else ()
    return Simulation(iteration, bubble, in_flight(schedule, pp, num_micro_batches, stages // pp),
                      actions)


def _per_step(structure: _Structure, table: list[float]) -> list[float]:
    """``table[structure.codes[i]]`` for each step (one C-level gather, not a Python loop)."""
    if not structure.codes:
        return []
    picked = operator.itemgetter(*structure.codes)(table)
    return list(picked) if len(structure.codes) > 1 else [picked]


def _link_s(structure: _Structure, transfer_s: tuple[Sequence[float], Sequence[float]] | None
            ) -> list[float]:
    """Per step, its output's time on the link: a forward sends to the stage after, a backward
    or input gradient to the stage before, a weights' gradient nothing."""
    if transfer_s is None:
        return [0.0] * len(structure.codes)
    forward, backward = list(transfer_s[0]), list(transfer_s[1])
    # Laid out as the codes are: F, B, W (sends nothing), I.
    return _per_step(structure, [*forward, *backward, *[0.0] * len(forward), *backward])


def _plain_times(structure: _Structure, durations: list[float], pp: int, late_receive_s: float,
                 link_s: list[float]) -> tuple[list[float], list[float]]:
    """Start and end of each step: when its device is free and its inputs have arrived
    (pipec.cost.cores.arrival_s, written out here: this loop runs for every step of every
    point the search times)."""
    devices, firsts, seconds = structure.devices, structure.firsts, structure.seconds
    end = [0.0] * len(durations)
    free = [0.0] * pp
    for i, duration in enumerate(durations):
        device = devices[i]
        posted = ready = free[device]
        for need in (firsts[i], seconds[i]):
            if need < 0:
                continue
            arrived = end[need]
            if devices[need] != device:
                arrived = (arrived if arrived > posted else posted + late_receive_s) + link_s[need]
            if arrived > ready:
                ready = arrived
        end[i] = free[device] = ready + duration
    return [e - d for e, d in zip(end, durations, strict=True)], end


@dataclass(frozen=True)
class _Structure:
    """What a schedule's timing does not change: the actions in an order where each comes after
    the two actions it may wait for, as columns. Per step: its kind, stage, micro-batch and
    device, the two steps it needs (indices; -1: none), and its duration's place in simulate's
    table [forwards, backwards, weights' gradients, input gradients], each one per stage."""

    kinds: tuple[str, ...]
    stages: tuple[int, ...]
    micro_batches: tuple[int, ...]
    devices: tuple[int, ...]
    firsts: tuple[int, ...]
    seconds: tuple[int, ...]
    codes: tuple[int, ...]

    @functools.cached_property
    def steps(self) -> Steps:
        """The same as rows (kind, stage, micro-batch, device, needs): pipec.cost.cores's form."""
        return tuple(zip(self.kinds, self.stages, self.micro_batches, self.devices, self.firsts,
                         self.seconds, strict=True))


# Actions are numbered (stage · M + micro-batch) · 3 + their kind's code: a full backward and
# the input's gradient share one, since the stage before waits for either.
_CODES = {"F": 0, "B": 1, "I": 1, "W": 2}
# Where each kind's durations sit in simulate's table of per-stage times.
_TABLE = {"F": 0, "B": 1, "W": 2, "I": 3}


@functools.lru_cache(maxsize=64)
def _structure(schedule: str, pp: int, num_micro_batches: int, virtual: int) -> _Structure:
    """Each device runs its order; a device blocked on an action not yet placed waits for it.
    An action waits for at most two others: a forward for the stage before's; a backward (or
    input gradient) for its own forward and the stage after's backward; a weights' gradient
    for its own input gradient."""
    orders = [action_order(schedule, d, pp, num_micro_batches, virtual) for d in range(pp)]
    stages, m = pp * virtual, num_micro_batches
    stride, last = 3 * m, stages - 1  # from an action's number to the next stage's
    placed = [-1] * (3 * stages * m)  # action number → its step, once placed
    columns: tuple[list[Any], ...] = ([], [], [], [], [], [], [])
    kinds, stage_of, micro_batch_of, devices, firsts, seconds, codes = columns
    position = [0] * pp
    runnable = collections.deque(range(pp))
    waiting: dict[int, list[int]] = {}
    while runnable:
        d = runnable.popleft()
        order, at = orders[d], position[d]
        while at < len(order):
            kind, s, k = order[at]
            own = (s * m + k) * 3
            if kind == "F":
                first, second = (own - stride if s else -1), -1
            elif kind == "W":
                first, second = own + 1, -1
            else:
                first, second = own, (own + stride + 1 if s < last else -1)
            missing_first = first >= 0 and placed[first] < 0
            if missing_first or (second >= 0 and placed[second] < 0):
                waiting.setdefault(first if missing_first else second, []).append(d)
                break
            number = own + _CODES[kind]
            placed[number] = len(kinds)
            kinds.append(kind)
            stage_of.append(s)
            micro_batch_of.append(k)
            devices.append(d)
            firsts.append(placed[first] if first >= 0 else -1)
            seconds.append(placed[second] if second >= 0 else -1)
            codes.append(_TABLE[kind] * stages + s)
            at += 1
            if number in waiting:
                runnable.extend(waiting.pop(number))
        position[d] = at
    if any(position[d] < len(orders[d]) for d in range(pp)):
        raise RuntimeError(f"schedule {schedule} deadlocks")  # a bug in action_order
    return _Structure(*(tuple(column) for column in columns))
