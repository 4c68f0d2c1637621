"""Exact dynamic programming over contiguous stages: minimize the slowest stage under memory.

Pure numbers in, numbers out (numpy, no torch), so it can be checked against brute force.

Legend: n nodes in topological order; a stage covers nodes [j, i) and is cut at j and i;
``time[s, i] - time[s, j]`` is its compute time on stage s's device (devices may differ),
``cut_s[s, i]`` the cost of stage s sending its output (per stage, since the link to the next
stage may be inter-node);
stage s holds its static bytes once and its activation bytes ``in_flight[s]`` times.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Problem:
    """Prefix sums (length n + 1) of per-node costs, the cuts allowed, and each stage's limits."""

    time: np.ndarray  # (num_stages, n + 1): a stage's time depends on the device it lands on
    cut_s: np.ndarray  # (num_stages, n + 1)
    static_bytes: np.ndarray
    activation_bytes: np.ndarray
    legal: np.ndarray  # bool, legal[i]: a boundary may sit before node i
    capacity: tuple[float, ...]  # bytes available to each stage
    in_flight: tuple[int, ...]  # micro-batches whose activations each stage holds at once

    @property
    def num_nodes(self) -> int:
        return self.time.shape[1] - 1

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

    ``costs`` and ``cut_s`` are one row for all stages or one row per stage.
    """
    def prefix(values: np.ndarray) -> np.ndarray:
        values = np.asarray(values, float)
        return np.concatenate((np.zeros((*values.shape[:-1], 1)),
                               np.cumsum(values, axis=-1)), axis=-1)
    n, stages = np.shape(costs)[-1], len(capacity)
    time = np.broadcast_to(prefix(costs), (stages, n + 1))
    cut = np.broadcast_to(np.asarray(cut_s, float), (stages, n + 1))
    return Problem(time, cut, prefix(static), prefix(activation), np.asarray(legal, bool),
                   capacity, in_flight)


def stage_time(p: Problem, stage: int, start: int, end: int) -> float:
    return float(p.time[stage, end] - p.time[stage, start] + p.cut_s[stage, end])


def stage_memory(p: Problem, stage: int, start: int, end: int) -> float:
    activations = p.activation_bytes[end] - p.activation_bytes[start]
    return float(p.static_bytes[end] - p.static_bytes[start] + p.in_flight[stage] * activations)


def solve(p: Problem) -> Partition | None:
    """The partition minimizing the bottleneck, or None when no partition fits in memory.

    Only legal cuts can be boundaries, so the DP runs over them alone (the nodes between two
    legal cuts always travel together), one stage at a time, all ends at once:
    ``best[s][e] = min over b < e of max(best[s-1][b], time of stage s over [b, e))``.
    """
    cuts = np.flatnonzero(p.legal)
    if cuts[0] != 0 or cuts[-1] != p.num_nodes:
        raise ValueError("the first and the last position must be legal cuts")
    grid = _Grid(p, cuts)
    best = np.full(len(cuts), np.inf)
    best[0] = 0.0
    choices = []
    for s in range(p.num_stages):
        values = np.where(grid.allowed(s) & np.isfinite(best)[None, :],
                          np.maximum(best[None, :], grid.time(s)), np.inf)
        choice = np.argmin(values, axis=1)
        best = values[np.arange(len(cuts)), choice]
        choices.append(choice)
    if not np.isfinite(best[-1]):
        return None
    return Partition(_backtrack(choices, cuts), float(best[-1]))


class _Grid:
    """Stage costs for every (end, start) pair of legal cuts; rows are ends, columns starts."""

    def __init__(self, p: Problem, cuts: np.ndarray) -> None:
        self.p, self.cuts = p, cuts
        self.before = np.tri(len(cuts), k=-1, dtype=bool)  # start < end: no empty stage
        self.static = p.static_bytes[cuts][:, None] - p.static_bytes[cuts][None, :]
        self.activation = p.activation_bytes[cuts][:, None] - p.activation_bytes[cuts][None, :]
        self._allowed: dict[tuple[int, float], np.ndarray] = {}

    def time(self, stage: int) -> np.ndarray:
        t = self.p.time[stage, self.cuts]
        return t[:, None] - t[None, :] + self.p.cut_s[stage, self.cuts][:, None]

    def allowed(self, stage: int) -> np.ndarray:
        """Spans that are not empty and fit the stage's memory (cached: stages often share it)."""
        key = (self.p.in_flight[stage], self.p.capacity[stage])
        if key not in self._allowed:
            memory = self.static + key[0] * self.activation
            self._allowed[key] = self.before & (memory <= key[1])
        return self._allowed[key]


def _backtrack(choices: list[np.ndarray], cuts: np.ndarray) -> tuple[int, ...]:
    position = len(cuts) - 1
    bounds = [position]
    for choice in reversed(choices):
        position = int(choice[position])
        bounds.append(position)
    return tuple(int(cuts[i]) for i in reversed(bounds))


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
