"""Processes that share a CPU's cores: a pipeline's waiting devices lend theirs to the others.

A CPU plan's compute times carry the slowdown of every training process computing at once
(``Calibration.contention``: c, the slowest of P processes side by side, since training in step
waits for it; taken here as every process's slowdown). In a pipeline's bubbles fewer compute.
A rank blocked in a gloo receive holds no core (0.01 s of CPU over a 3 s wait, measured on a
2-core AMD EPYC VM), so the ranks that do compute run faster, at most as fast as alone.

Processor sharing (Kleinrock, 1967): P processes computing at once run c times slower than
alone, as if on P / c cores of their own; n of them computing run max(1, n·c / P) times slower.
Relative to the contended times the model uses (alone × c), that is a rate of
``min(c, P / n)``. With n = P it is 1: the plain simulation. With no contention (c = 1: a GPU
each) it is 1 for every n, and the plain simulation is used.

Where the runtime probe measured it (pipec.calibration.relay), n processes computing while the
others wait in a receive run s(n) times slower than alone, which can be more than processor
sharing says (the waiting processes are not free): the rate is then c / s(n), s(n) kept between
processor sharing's max(1, n·c / P) and c and growing with n, so that the simulation's bounds
(``bound_s``) still hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Work left below this many seconds is done (the times are sums of floats).
_DONE_S = 1e-15


@dataclass(frozen=True)
class SharedCores:
    """The processes of one machine sharing its cores; a pipeline's devices are ``replicas`` of
    them computing at once (data parallelism runs every replica's schedule in step)."""

    contention: float  # c: alone × c is each process's time when all P compute (the slowest's)
    processes: int  # P: the processes c was measured with (every training process)
    replicas: int = 1
    # Measured s(n) for n = 1 … P − 1 processes computing (pipec.calibration.relay); () :
    # processor sharing.
    relayed: tuple[float, ...] = ()

    def rate(self, computing: int) -> float:
        """Work done per second of a contended time, for each of ``computing`` pipeline
        devices that compute at once."""
        return self.contention / self.slowdown(computing * self.replicas)

    def slowdown(self, processes: int) -> float:
        """How much slower than alone each of ``processes`` computing at once runs: processor
        sharing's max(1, n·c / P), or more where measured, at most c, never less than with
        fewer processes computing."""
        c, p = self.contention, self.processes
        shared = [max(1.0, n * c / p) for n in range(1, min(processes, p) + 1)]
        measured = list(self.relayed[:len(shared)])
        measured += [1.0] * (len(shared) - len(measured))
        return max(min(max(s, m), c) for s, m in zip(shared, measured, strict=True))

    @property
    def paired(self) -> float:
        """Contended ÷ measured, for a time measured with two processes computing and the rest
        waiting (the probe's links and runtime: pipec.calibration.probe): the rate with two
        computing, min(c, P / 2) under processor sharing."""
        return self.contention / self.slowdown(2)

    @property
    def shared(self) -> bool:
        """Whether a pipeline runs faster in its bubbles than its contended times say."""
        return self.rate(1) > 1

    def bound_s(self, plain_bound_s: float, balanced_s: float) -> float:
        """A lower bound on a step whose plain simulation is bounded by ``plain_bound_s``: no
        action runs faster than alone (rate(1)), and the devices together do at most pp
        devices' worth of contended work per second (n · rate(n) ≤ P / replicas = pp), so
        ``balanced_s`` (the work spread evenly) stands."""
        return max(plain_bound_s / self.rate(1), balanced_s)


Steps = tuple[tuple[str, int, int, int, int, int], ...]  # kind, stage, mb, device, needs


def arrival_s(steps: Steps, end: list[float], need: int, device: int, posted_s: float,
              late_receive_s: float, transfer_s: Sequence[float]) -> float:
    """When step ``need``'s output is ready on ``device``, whose receive was posted (its previous
    step ended) at ``posted_s``: ``transfer_s[need]`` after it is sent, at its end, or
    ``late_receive_s`` after the post where it ended before (pipec.planning.simulate); -1 needs
    nothing, and a step of the same device hands its output over in memory."""
    if need < 0:
        return 0.0
    if steps[need][3] == device:
        return end[need]
    sent = end[need] if end[need] > posted_s else posted_s + late_receive_s
    return sent + transfer_s[need]


def shared_times(steps: Steps, durations: list[float], pp: int, cores: SharedCores,
                 late_receive_s: float = 0.0, transfer_s: Sequence[float] | None = None
                 ) -> tuple[list[float], list[float]]:
    """Start and end of each step (kind, stage, micro-batch, device, the two steps it needs) when
    the devices computing at once share the cores: events from one action's end (or a late
    input's arrival) to the next, each computing device doing ``cores.rate(n)`` of its work
    per second."""
    queues: list[list[int]] = [[] for _ in range(pp)]
    for i in reversed(range(len(steps))):
        queues[steps[i][3]].append(i)  # each device's steps, next last
    start, end = [0.0] * len(steps), [float("inf")] * len(steps)
    free = [0.0] * pp  # when each device's last step ended: it posted its next receive then
    running: dict[int, list[float]] = {}  # device → [step, work left]
    now = 0.0
    arrive = _Arrivals(steps, end, free, late_receive_s, transfer_s or [0.0] * len(steps))
    wake = _start_ready(queues, durations, arrive, running, start, now)
    while running or wake < float("inf"):
        rate = cores.rate(len(running)) if running else 1.0
        first = min(running, key=lambda d: running[d][1], default=-1)
        to_end = running[first][1] / rate if running else float("inf")
        ends = to_end <= wake - now
        elapsed = to_end if ends else wake - now
        now = now + to_end if ends else wake
        for device in list(running):
            step, left = running[device]
            if (device == first and ends) or left - elapsed * rate <= _DONE_S:
                end[int(step)] = free[device] = now
                del running[device]
            else:
                running[device][1] = left - elapsed * rate
        wake = _start_ready(queues, durations, arrive, running, start, now)
    return start, end


@dataclass
class _Arrivals:
    """When each device's next step may start: its inputs arrived (``arrival_s``)."""

    steps: Steps
    end: list[float]
    free: list[float]
    late_receive_s: float
    transfer_s: Sequence[float]  # per step: its output's time on the link

    def ready_s(self, device: int, step: int) -> float:
        return max(arrival_s(self.steps, self.end, n, device, self.free[device],
                             self.late_receive_s, self.transfer_s) for n in self.steps[step][4:])


def _start_ready(queues: list[list[int]], durations: list[float], arrive: _Arrivals,
                 running: dict[int, list[float]], start: list[float], now: float) -> float:
    """Start each idle device's next step whose inputs have arrived; returns when the next of
    the others may start (a late input arriving; infinite where each waits for a step still
    running)."""
    wake = float("inf")
    for device, queue in enumerate(queues):
        if device in running or not queue:
            continue
        step = queue[-1]
        ready = arrive.ready_s(device, step)
        if ready <= now:
            queue.pop()
            start[step] = now
            running[device] = [float(step), durations[step]]
        else:
            wake = min(wake, ready)
    return wake
