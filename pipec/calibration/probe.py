"""The training runtime on this machine's CPU processes: what a roofline cannot know, measured
with as many processes as the training will run on this machine (pipec.calibration.by_default
caches it). `side_by_side` measures how much slower a model's pass runs, in the slowest process,
when every process computes at once. The pipelining runtime's probes are in
pipec.calibration.action_times, the all-reduces' in pipec.calibration.allreduce_times.

- **links**: blocking send/recv between two processes (gloo) at four sizes, fitted as
  latency + bytes / bandwidth (least squares on relative errors);
- **per action**: a two-stage torch.distributed.pipelining schedule of a 4-wide linear layer,
  its forward and backward calls timed, less the same layer's plain forward and backward: the
  runtime's own time per action;
- **per action, by schedule**: the same layer as a 2-device pipeline under each schedule (two
  stages per device where the schedule has more), whole steps timed, the schedules in turns:
  the schedule runtime's sends, receives and bookkeeping between actions
  (pipec.calibration.runtime_fit fits them per action);
- **split backward**: a 32-operation stack of linear layers, its backward run whole and split
  as the zero-bubble schedules split it (torch's stage_backward_input and
  stage_backward_weight, which walk the autograd graph in Python): the extra time per recorded
  operation;
- **all-reduce**: 4 MiB over every process, as bus bandwidth 2(d−1)/d · bytes / seconds;
- **per step**: an all-reduce of one value (train.py shares the loss every step);
- **data-parallel steps**: a stack of linear layers trained under DistributedDataParallel over
  every process, with the loss's all-reduce, against the same steps without them, at two
  gradient sizes (pipec.calibration.runtime_fit fits DDP's time per step in context: its
  all-reduces start after compute, when gloo's threads must wake on cores the training keeps
  busy), and again
  on each smaller group a pp × dp layout has (2 of 4 processes), the others waiting;
- **blocking all-reduces**: conv → BatchNorm → ReLU blocks with an all-reduce of a BatchNorm's
  statistics after each, forward and backward, against the same blocks without, at two image
  sizes: what a synchronized BatchNorm's waits cost in a pass (pipec.calibration.allreduce_times);
- **relayed compute**: a fixed pass relayed round the processes, n = 1 … P − 1 of them
  computing at once, against the pass alone, in rounds (pipec.calibration.relay): how fast a
  pipeline's devices compute in its bubbles;
- **late receives**: micro-batches sent down a chain of every process, each computing a pass:
  how long an input sent before its receiver asked for it takes to arrive
  (pipec.calibration.receive_times).
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import queue
import socket
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipec.calibration.action_times import (
    action_overhead_s,
    schedule_steps,
    selective_node_s,
    split_backward_node_s,
)
from pipec.calibration.allreduce_times import (
    ALLREDUCE_BYTES,
    DATA_PARALLEL_SHAPES,
    allreduce_s,
    blocking_s,
    data_parallel_s,
    group_data_parallel_s,
    replica_counts,
    step_s,
)
from pipec.calibration.heap import set_training_heap
from pipec.calibration.receive_times import chain_records, late_receive_s
from pipec.calibration.relay import relayed_s, slowdowns
from pipec.calibration.timers import device_now, mean_s, span_s

log = logging.getLogger(__name__)

LINK_SIZES = (4, 64 * 1024, 1024 * 1024, 4 * 1024 * 1024)
TIMEOUT_S = 120  # a worker that fails or is killed must not hang the compile
CPU = torch.device("cpu")


@dataclass(frozen=True)
class RuntimeFigures:
    processes: int
    latency_s: float  # 0 with one process: nothing to measure
    bandwidth: float  # bytes/s
    action_overhead_s: float
    allreduce_bandwidth: float  # bus bandwidth, bytes/s
    step_overhead_s: float
    # Per schedule, a step of the 2-device pipeline of SCHEDULE_MICRO_BATCHES micro-batches.
    schedule_step_s: dict[str, float]
    split_backward_node_s: float  # what a split backward adds per autograd operation
    # Per DATA_PARALLEL_SHAPES, the step without data parallelism (the median process's) and
    # what a data-parallel step adds to it, seconds.
    data_parallel_s: tuple[tuple[float, float], ...]
    # What selective recomputation adds per autograd operation, forward or recomputing.
    selective_node_s: float
    # Per size of the blocking probe (pipec.calibration.allreduce_times): the compute between
    # two blocking all-reduces and what each adds to the step, seconds (none with one process).
    blocking_s: tuple[tuple[float, float], ...]
    # Per n = 1 … processes − 1 computing at once, a relayed pass ÷ the pass alone
    # (pipec.calibration.relay).
    relay_slowdowns: tuple[float, ...] = ()
    # Seconds from a receive's post to its input's arrival where the input was sent before
    # (pipec.calibration.receive_times; 0 with one process).
    late_receive_s: float = 0.0
    # Per group of fewer replicas than processes (allreduce_times.replica_counts), as
    # ``data_parallel_s`` on that many processes while the others wait.
    group_data_parallel_s: tuple[tuple[int, tuple[tuple[float, float], ...]], ...] = ()
    # "cuda" where measured on GPUs (pipec.calibration.gpu_probe): links, all-reduce and the
    # runtime's time per action and step only; the fields above it leaves empty or 0.
    device_type: str = "cpu"


def probe_runtime(processes: int, threads: int) -> RuntimeFigures:
    """Fork ``processes`` workers with ``threads`` threads each and measure; one process
    measures only itself (no links, no contention). The workers' heap is train.py's
    (pipec.calibration.heap)."""
    set_training_heap()
    if processes < 2:
        return RuntimeFigures(1, 0.0, 0.0, 0.0, 0.0, 0.0, {}, 0.0,
                              ((0.0, 0.0),) * len(DATA_PARALLEL_SHAPES),
                              selective_node_s(), ())
    by_rank = run_workers("fork", _worker, processes, threads)
    figures = _combine(processes, by_rank)
    return replace(figures, relay_slowdowns=slowdowns([f["relay"] for f in by_rank]),
                   late_receive_s=late_receive_s([f["receives"] for f in by_rank]))


def run_workers(start: str, worker: Callable[..., None], processes: int, *args: Any
                ) -> list[dict[str, Any]]:
    """``worker(rank, processes, port, *args, results)`` in ``processes`` processes started by
    ``start`` ("fork"; "spawn" once CUDA may have started here), each putting (rank, its
    figures) or (rank, why it failed) on ``results``: the figures by rank, or RuntimeError."""
    context = mp.get_context(start)
    results = context.Queue()
    port = free_port()
    workers = [context.Process(target=worker, args=(rank, processes, port, *args, results))
               for rank in range(processes)]
    for process in workers:
        process.start()
    try:
        received = [results.get(timeout=TIMEOUT_S) for _ in workers]
    except queue.Empty:
        raise RuntimeError(f"the runtime probe's workers did not answer in {TIMEOUT_S} s") \
            from None
    finally:
        for process in workers:
            process.join(timeout=5)
            if process.is_alive():
                process.terminate()
    failed = [f for _, f in received if isinstance(f, str)]
    if failed:
        raise RuntimeError(failed[0])
    return [f for _, f in sorted(received, key=lambda rf: rf[0])]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(rank: int, world: int, port: int, threads: int, results: Any) -> None:
    try:
        torch.set_num_threads(threads)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=TIMEOUT_S))
        figures = {"links": links_one_way(rank),
                   "action": action_overhead_s(rank), "schedules": schedule_steps(rank),
                   "split": split_backward_node_s(), "selective": selective_node_s(),
                   "allreduce": allreduce_s(), "step": step_s(),
                   "data_parallel": [data_parallel_s(*shape) for shape in DATA_PARALLEL_SHAPES],
                   "groups": {d: group_data_parallel_s(rank, d) for d in replica_counts(world)},
                   "blocking": blocking_s(), "relay": relayed_s(rank, world),
                   "receives": chain_records(rank, world)}
        dist.destroy_process_group()
        results.put((rank, figures))
    except Exception as exc:  # reported to the parent, which raises it
        results.put((rank, f"rank {rank}: {exc!r}"))


def side_by_side(run: Callable[[], object], processes: int, rounds: int = 6,
                 min_seconds: float = 0.4) -> float:
    """How much slower ``run`` is, in the slowest of ``processes`` processes running it at once,
    than alone (at least 1): they share the machine's cores, caches and memory bandwidth. The
    others are forked copies, waiting on a semaphore between rounds (not in torch.distributed,
    whose waits would hold a core). The median over ``rounds`` rounds, each timing ``run``
    alone and together for at least ``min_seconds``, in alternating order, since the machine's
    speed drifts by the second: on a 2-core AMD EPYC VM one such pair ranged from 1.01 to 1.42
    for the ResNet sample within a minute."""
    if processes < 2:
        return 1.0
    repeats = math.ceil(min_seconds / mean_s(run, 1))  # warm, then timed
    context = mp.get_context("fork")
    barrier, stop = context.Barrier(processes, timeout=TIMEOUT_S), context.Event()
    results = context.Queue()
    copies = [context.Process(target=_run_together, args=(run, rounds, barrier, stop, results))
              for _ in range(processes - 1)]
    for copy in copies:
        copy.start()
    try:
        ratios = []
        for round_ in range(rounds):
            if round_ % 2 == 0:
                alone = span_s(run, repeats)
                together = _together(run, repeats, barrier, stop, results, len(copies))
            else:
                together = _together(run, repeats, barrier, stop, results, len(copies))
                alone = span_s(run, repeats)
            ratios.append(together / alone)
        barrier.wait()  # the copies exit only now, outside the last timing
    except (threading.BrokenBarrierError, queue.Empty):
        raise RuntimeError(f"the side-by-side copies did not answer in {TIMEOUT_S} s") from None
    finally:
        stop.set()
        barrier.abort()  # after a failure here, the copies waiting are let go
        for copy in copies:
            copy.join(timeout=5)
            if copy.is_alive():
                copy.terminate()
    return max(float(statistics.median(ratios)), 1.0)


def _together(run: Callable[[], object], repeats: int, barrier: Any, stop: Any, results: Any,
              copies: int) -> float:
    """One round side by side: the slowest process's seconds per run, since training in step
    waits for its slowest rank (on a 2-core AMD EPYC VM one vCPU ran the GPT sample 1.5× slower
    than the other for a whole second).
    The copies run until this process has timed its ``repeats`` and report once their run in
    progress ends."""
    stop.clear()
    barrier.wait()
    mine = span_s(run, repeats)
    stop.set()
    return float(max([mine] + [results.get(timeout=TIMEOUT_S) for _ in range(copies)]))


def _run_together(run: Callable[[], object], rounds: int, barrier: Any, stop: Any,
                  results: Any) -> None:
    try:
        for _ in range(rounds):
            barrier.wait()
            results.put(_until_stopped(run, stop))
        barrier.wait()
    except threading.BrokenBarrierError:
        return  # the measuring process gave up: it reports why


def _until_stopped(run: Callable[[], object], stop: Any) -> float:
    """Seconds per run, running until ``stop`` is set. The last run overlapped the stop, partly
    alone: left out where others were whole (a pass longer than the round keeps its one run)."""
    ends = [time.perf_counter()]
    while len(ends) < 2 or not stop.is_set():
        run()
        ends.append(time.perf_counter())
    whole = ends[:-1] if len(ends) > 2 else ends
    return (whole[-1] - whole[0]) / (len(whole) - 1)


def links_one_way(rank: int, device: torch.device = CPU,
                  sizes: tuple[int, ...] = LINK_SIZES) -> dict[int, float]:
    """One-way seconds per size between ranks 0 and 1 (half the median round trip)."""
    one_way = {}
    for size in sizes:
        tensor = torch.zeros(size // 4, device=device)
        trips = []
        for _ in range(12):
            dist.barrier()
            started = time.perf_counter()
            if rank == 0:
                dist.send(tensor, 1)
                dist.recv(tensor, 1)
            elif rank == 1:
                dist.recv(tensor, 0)
                dist.send(tensor, 0)
            trips.append(device_now(device) - started)
        one_way[size] = statistics.median(trips[2:]) / 2
    return one_way


def _combine(processes: int, figures: list[dict[str, Any]]) -> RuntimeFigures:
    latency, bandwidth = fit_link(figures[0]["links"])
    action = statistics.median(f["action"] for f in figures[:2])
    allreduce = max(f["allreduce"] for f in figures)
    bus = 2 * (processes - 1) / processes * ALLREDUCE_BYTES / allreduce
    return RuntimeFigures(processes, latency, bandwidth, action, bus,
                          max(f["step"] for f in figures),
                          {s: max(figures[0]["schedules"][s], figures[1]["schedules"][s])
                           for s in figures[0]["schedules"]},
                          statistics.median(f["split"] for f in figures),
                          _compute_and_extra([f["data_parallel"] for f in figures]),
                          statistics.median(f["selective"] for f in figures),
                          _compute_and_extra([f["blocking"] for f in figures]),
                          group_data_parallel_s=tuple(
                              (d, _compute_and_extra([f["groups"][d] for f in figures[:d]]))
                              for d in replica_counts(processes)))


def _compute_and_extra(steps: list[list[tuple[float, float]]]
                       ) -> tuple[tuple[float, float], ...]:
    """Per size of a probe (``steps``: each process's (compute, extra) per size), the median
    compute over the processes and the largest extra time: every process waits for the
    slowest, so each measures about the same step."""
    return tuple((statistics.median(f[i][0] for f in steps), max(f[i][1] for f in steps))
                 for i in range(len(steps[0])))


def fit_link(one_way: dict[int, float]) -> tuple[float, float]:
    """latency + bytes / bandwidth, least squares on relative errors."""
    sizes = np.array(sorted(one_way), dtype=float)
    seconds = np.array([one_way[int(s)] for s in sizes])
    design = np.column_stack([np.ones_like(sizes), sizes]) / seconds[:, None]
    (latency, per_byte), *_ = np.linalg.lstsq(design, np.ones_like(sizes), rcond=None)
    return max(float(latency), 0.0), 1 / max(float(per_byte), 1e-15)
