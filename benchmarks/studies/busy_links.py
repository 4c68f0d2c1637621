"""What a pipeline's sends cost when every core is busy computing: a 2-device torch pipeline
whose stages hold their core for a fixed time per action (spin) against the same pipeline whose
stages give it up for that time (sleep), on two processes of one thread each.

    python benchmarks/studies/busy_links.py [--work-ms 2] [--micro-batches 8] [--rounds 3]
                                    [--tensors 1 2 4]

Why: gloo's point-to-point send is a rendezvous. The receiver posts its receive and tells the
sender; the sender's gloo thread, woken by that message, writes the data (gloo's
transport/tcp/pair.cc). When both cores run a stage's compute, that thread must wait for a core,
and so must the receiver's when the data lands. pipec's runtime probe times the schedules with a
4-wide layer, whose cores are idle between sends, so it cannot see this.

With ``--tensors K ...`` the boundary carries K tensors (4 floats in all per sample, split):
torch's runtime sends each on its own, and the step's growth per extra tensor is what a
boundary's tensor costs beyond the first (pipec.cost.model.boundary_s charges each the link's
latency).

Each round times GPipe's and 1F1B's step (the median of 12 after 2 warm-ups) with spinning and
with sleeping stages, in alternating order. The difference, divided by the step's 2 × N sends
(every micro-batch's activation and its gradient), is what a send costs more on busy cores. A
sleep lasts longer than asked (the timer's slack and the wake-up): the measured sleep is printed
too, and since it only lengthens the sleeping pipeline's step, the difference is an underestimate.
"""

from __future__ import annotations

import argparse
import os
import queue
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tabulate import tabulate
from torch import nn
from torch.distributed import pipelining

SCHEDULES = ("ScheduleGPipe", "Schedule1F1B")
STEPS, WARM_UP = 12, 2
TIMEOUT_S = 1200


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-ms", type=float, default=2.0, help="per action (2)")
    parser.add_argument("--micro-batches", type=int, default=8, help="(8)")
    parser.add_argument("--rounds", type=int, default=3, help="(3)")
    parser.add_argument("--tensors", type=int, nargs="+", default=[1], choices=(1, 2, 3, 4),
                        help="tensors a boundary carries, each measured (1)")
    args = parser.parse_args()
    figures = on_two_processes(_worker, args)
    _report(figures, args)


def on_two_processes(worker: Callable[..., None], *arguments: Any) -> Any:
    """What rank 0 of two forked processes puts in the queue: each runs ``worker(rank, port,
    *arguments, results)``."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("fork")
    results = context.Queue()
    workers = [context.Process(target=worker, args=(rank, port, *arguments, results))
               for rank in (0, 1)]
    for process in workers:
        process.start()
    try:
        return results.get(timeout=TIMEOUT_S)  # a worker that died answers never
    except queue.Empty:
        raise SystemExit(f"the workers did not answer in {TIMEOUT_S} s") from None
    finally:
        for process in workers:
            process.join(timeout=5)
            if process.is_alive():
                process.terminate()


def join_pair(rank: int, port: int) -> None:
    """This process into the 2-process gloo group, computing on one thread."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)


class _Hold(torch.autograd.Function):
    """The identity, holding the core (spin) or giving it up (sleep) for ``seconds`` in its
    forward and again in its backward: a stage's compute, without the compute's own noise."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float, spin: bool) -> torch.Tensor:
        ctx.seconds, ctx.spin = seconds, spin
        _hold(seconds, spin)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        _hold(ctx.seconds, ctx.spin)
        return grad.clone(), None, None


SLEPT: list[float] = []


def _hold(seconds: float, spin: bool) -> None:
    started = time.perf_counter()
    if spin:
        while time.perf_counter() - started < seconds:
            pass
    else:
        time.sleep(seconds)
        SLEPT.append(time.perf_counter() - started)


class _Stage(nn.Module):
    """A 4-wide layer holding the core; the first stage sends its output as ``tensors`` pieces,
    the last joins them."""

    def __init__(self, seconds: float, spin: bool, tensors: int, first: bool) -> None:
        super().__init__()
        self.layer, self.seconds, self.spin = nn.Linear(4, 4), seconds, spin
        self.tensors, self.first = tensors, first

    def forward(self, *xs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        held = _Hold.apply(self.layer(torch.cat(xs, dim=1)), self.seconds, self.spin)
        if not self.first or self.tensors == 1:
            return held
        return tuple(piece.contiguous() for piece in held.tensor_split(self.tensors, dim=1))


def _worker(rank: int, port: int, args: argparse.Namespace, results: Any) -> None:
    join_pair(rank, port)
    steps: dict[tuple[str, bool, int], list[float]] = {}
    for round_ in range(args.rounds):
        for schedule in SCHEDULES:
            for tensors in args.tensors if round_ % 2 == 0 else args.tensors[::-1]:
                for spin in (True, False) if round_ % 2 == 0 else (False, True):
                    steps.setdefault((schedule, spin, tensors), []).append(
                        _step_s(rank, schedule, spin, tensors, args))
    if rank == 0:
        results.put({"steps": steps, "slept": statistics.median(SLEPT)})
    dist.destroy_process_group()


def _step_s(rank: int, schedule: str, spin: bool, tensors: int,
            args: argparse.Namespace) -> float:
    torch.manual_seed(0)
    stage = pipelining.PipelineStage(_Stage(args.work_ms / 1e3, spin, tensors, rank == 0), rank,
                                     2, torch.device("cpu"))
    runner = getattr(pipelining, schedule)(stage, args.micro_batches,
                                           loss_fn=lambda out, target: out.sum())
    return median_step_s(runner, rank, torch.ones(args.micro_batches, 4))


def median_step_s(runner: Any, rank: int, inputs: torch.Tensor) -> float:
    """The median of STEPS steps of a 2-rank schedule after WARM_UP, each started together."""
    times = []
    for _ in range(STEPS + WARM_UP):
        dist.barrier()
        started = time.perf_counter()
        runner.step(*((inputs,) if rank == 0 else ()), target=inputs if rank == 1 else None)
        times.append(time.perf_counter() - started)
    return statistics.median(times[WARM_UP:])


def _report(figures: dict[str, Any], args: argparse.Namespace) -> None:
    sends = 2 * args.micro_batches
    fewest = min(args.tensors)
    rows = []
    for schedule in SCHEDULES:
        for tensors in sorted(args.tensors):
            spin, sleep = (figures["steps"][(schedule, s, tensors)] for s in (True, False))
            extra = [(a - b) / sends for a, b in zip(spin, sleep, strict=True)]
            base = statistics.median(figures["steps"][(schedule, True, fewest)])
            more = (statistics.median(spin) - base) / (sends * max(tensors - fewest, 1))
            per_tensor = "" if tensors == fewest else f"{more * 1e6:.0f}"
            rows.append((schedule.removeprefix("Schedule"), tensors,
                         f"{statistics.median(spin) * 1e3:.2f}",
                         f"{statistics.median(sleep) * 1e3:.2f}",
                         f"{statistics.median(extra) * 1e6:.0f}",
                         " ".join(f"{e * 1e6:.0f}" for e in extra), per_tensor))
    print(f"2 processes, {args.micro_batches} micro-batches, {args.work_ms} ms a stage per "
          f"forward and per backward (a sleep of it measured "
          f"{figures['slept'] * 1e3:.2f} ms), median over {args.rounds} rounds\n")
    print(tabulate(rows, ("schedule", "tensors a boundary", "step ms, busy cores",
                          "step ms, idle cores", "µs more a send", "per round",
                          f"µs a send per tensor beyond {fewest}, busy"), tablefmt="github"))


if __name__ == "__main__":
    main()
