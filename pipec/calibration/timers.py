"""Wall-clock timing: of a repeated run, as the runtime probes take it (pipec.calibration.probe,
pipec.calibration.allreduce_times), and of a device's work (the profile's helpers)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping

import torch


def median_s(run: Callable[[], object], repeats: int) -> float:
    """The median seconds of ``repeats`` runs, after one to warm up."""
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def median_in_turns(runs: Mapping[str, Callable[[], object]], rounds: int
                    ) -> dict[str, float]:
    """Each run's median seconds over ``rounds`` rounds of every run once, after one to warm up."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds + 1):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(seconds[1:]) for name, seconds in times.items()}


def mean_s(run: Callable[[], object], repeats: int) -> float:
    """Seconds per run over ``repeats`` runs in a row, after one to warm up. The whole span,
    not a median of runs: processes sharing a core take turns in time slices longer than a
    short run, so most single runs would see a core of their own."""
    run()
    return span_s(run, repeats)


def span_s(run: Callable[[], object], repeats: int) -> float:
    """Seconds per run over ``repeats`` runs in a row, with no run to warm up."""
    started = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - started) / repeats


def synchronized(run: Callable[[], object], device: torch.device) -> Callable[[], None]:
    """``run``, then a wait until ``device`` has finished it: a GPU's collectives and kernels
    return to the host before they run, so a timer of ``run`` alone times only their launch."""
    def run_and_wait() -> None:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return run_and_wait


def device_now(device: torch.device) -> float:
    """The clock once ``device`` has finished what was queued on it (a GPU runs behind)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
