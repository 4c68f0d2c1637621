"""Exact dynamic programming over contiguous stages: minimize the slowest stage under memory.

Pure numbers in, numbers out (numpy, no torch), so it can be checked against brute force.

Legend: n nodes in topological order; a stage covers nodes [j, i) and is cut at j and i;
``time[i] - time[j]`` is its compute time, ``cut_s[s, i]`` the cost of stage s sending its output
(per stage, since the link to the next stage may be inter-node);
stage s holds its static bytes once and its activation bytes ``in_flight[s]`` times.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Problem:
    """Prefix sums (length n + 1) of per-node costs, the cuts allowed, and each stage's limits."""

    time: np.ndarray
    cut_s: np.ndarray  # (num_stages, n + 1)
    static_bytes: np.ndarray
    activation_bytes: np.ndarray
    legal: np.ndarray  # bool, legal[i]: a boundary may sit before node i
    capacity: tuple[float, ...]  # bytes available to each stage
    in_flight: tuple[int, ...]  # micro-batches whose activations each stage holds at once

    @property
    def num_nodes(self) -> int:
        return len(self.time) - 1

    @property
    def num_stages(self) -> int:
        return len(self.capacity)


@dataclass(frozen=True)
class Partition:
    boundaries: tuple[int, ...]  # num_stages + 1 cuts, 0 first and n last
    bottleneck: float  # the slowest stage's time


def make_problem(costs: np.ndarray, static: np.ndarray, activation: np.ndarray,
                 cut_s: np.ndarray, legal: np.ndarray, capacity: tuple[float, ...],
                 in_flight: tuple[int, ...]) -> Problem:
    """Build a Problem from per-node arrays (length n) and per-cut arrays (length n + 1).

    ``cut_s`` is one row for all stages or one row per stage.
    """
    def prefix(values: np.ndarray) -> np.ndarray:
        return np.concatenate(([0.0], np.cumsum(values, dtype=float)))
    cut = np.broadcast_to(np.asarray(cut_s, float), (len(capacity), len(costs) + 1))
    return Problem(prefix(costs), cut, prefix(static), prefix(activation),
                   np.asarray(legal, bool), capacity, in_flight)


def stage_time(p: Problem, stage: int, start: int, end: int) -> float:
    return float(p.time[end] - p.time[start] + p.cut_s[stage, end])


def stage_memory(p: Problem, stage: int, start: int, end: int) -> float:
    activations = p.activation_bytes[end] - p.activation_bytes[start]
    return float(p.static_bytes[end] - p.static_bytes[start] + p.in_flight[stage] * activations)


def solve(p: Problem) -> Partition | None:
    """The partition minimizing the bottleneck, or None when no partition fits in memory."""
    n, stages = p.num_nodes, p.num_stages
    best = np.full((stages + 1, n + 1), np.inf)
    choice = np.zeros((stages + 1, n + 1), dtype=int)
    best[0, 0] = 0.0
    for s in range(1, stages + 1):
        for end in range(s, n + 1):
            if p.legal[end]:
                _relax(p, best, choice, s, end)
    if not np.isfinite(best[stages, n]):
        return None
    return Partition(_backtrack(choice, stages, n), float(best[stages, n]))


def _relax(p: Problem, best: np.ndarray, choice: np.ndarray, s: int, end: int) -> None:
    """best[s, end] = min over start of max(best[s-1, start], time of stage s-1 = [start, end))."""
    starts = np.arange(end)
    time = p.time[end] - p.time[:end] + p.cut_s[s - 1, end]
    memory = (p.static_bytes[end] - p.static_bytes[:end]
              + p.in_flight[s - 1] * (p.activation_bytes[end] - p.activation_bytes[:end]))
    ok = p.legal[:end] & (memory <= p.capacity[s - 1]) & np.isfinite(best[s - 1, :end])
    if not ok.any():
        return
    values = np.where(ok, np.maximum(best[s - 1, :end], time), np.inf)
    k = int(np.argmin(values))
    best[s, end] = values[k]
    choice[s, end] = starts[k]


def _backtrack(choice: np.ndarray, stages: int, n: int) -> tuple[int, ...]:
    cuts = [n]
    for s in range(stages, 0, -1):
        cuts.append(int(choice[s, cuts[-1]]))
    return tuple(reversed(cuts))


def brute_force(p: Problem) -> Partition | None:
    """Every placement of the inner cuts; the reference the DP is tested against."""
    n, stages = p.num_nodes, p.num_stages
    inner = [i for i in range(1, n) if p.legal[i]]
    best: Partition | None = None
    for cuts in itertools.combinations(inner, stages - 1):
        bounds = (0, *cuts, n)
        spans = list(itertools.pairwise(bounds))
        if any(stage_memory(p, s, a, b) > p.capacity[s] for s, (a, b) in enumerate(spans)):
            continue
        bottleneck = max(stage_time(p, s, a, b) for s, (a, b) in enumerate(spans))
        if best is None or bottleneck < best.bottleneck:
            best = Partition(bounds, bottleneck)
    return best
