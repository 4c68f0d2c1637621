"""Exact dynamic programming over contiguous stages: minimize the slowest stage under memory.

Pure numbers in, numbers out (numpy, no torch), so it can be checked against brute force.
The problem, its legend and what one stage costs over one span are `pipec.planning.spans`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from pipec.planning.spans import Problem, recomputations, stage_choice


@dataclass(frozen=True)
class Partition:
    boundaries: tuple[int, ...]  # num_stages + 1 cuts, 0 first and n last
    bottleneck: float  # the slowest stage's time
    recompute: tuple[str, ...] = ()  # per stage: one of spans.RECOMPUTE_MODES


def solve(p: Problem) -> Partition | None:
    """The partition minimizing the bottleneck, or None when no partition fits in memory.

    Only legal cuts can be boundaries, so the DP runs over them alone (the nodes between two
    legal cuts always travel together), one stage at a time, all ends at once:
    ``best[s][e] = min over b < e of max(best[s-1][b], time of stage s over [b, e))``.
    A feasible partition's bottleneck U bounds the optimum, so only spans no slower than U are
    tried: for each end, a window of starts (span time grows as the start moves back).
    """
    cuts = np.flatnonzero(p.legal)
    if cuts[0] != 0 or cuts[-1] != p.num_nodes:
        raise ValueError("the first and the last position must be legal cuts")
    k, stages = len(cuts), p.num_stages
    if stages > k - 1 or least_bytes(p) > sum(p.capacity):
        return None  # fewer legal spans than stages, or the model cannot fit however cut
    grid = _Grid(p, cuts, _upper_bound(p, cuts))
    best = np.full(k, np.inf)
    best[0] = 0.0
    choices = []
    for s in range(stages):
        # After s stages the cut sits at position ≥ s, and leaves a position for each stage
        # still to come: only ends in that band can be on a partition.
        ends = np.arange(s + 1, k - stages + s + 1)
        starts, valid = grid.starts(s, ends)
        previous = best[starts]
        values = np.where(valid & np.isfinite(previous),
                          np.maximum(previous, grid.cost(s, ends, starts)), np.inf)
        local = np.argmin(values, axis=1)
        rows = np.arange(len(ends))
        best = np.full(k, np.inf)
        best[ends] = values[rows, local]
        choice = np.zeros(k, dtype=int)
        choice[ends] = starts[rows, local]
        choices.append(choice)
    if not np.isfinite(best[-1]):
        return None
    bounds = _backtrack(choices, cuts)
    chosen = [stage_choice(p, s, a, b) for s, (a, b) in enumerate(itertools.pairwise(bounds))]
    return Partition(bounds, float(best[-1]), tuple(c[1] if c else "none" for c in chosen))


def least_bytes(p: Problem) -> float:
    """What the stages hold together at the least, however the model is cut: every node's
    static bytes (less its gradients where a stage may peak before them) and one micro-batch's
    activations, which a stage holds recomputing or not (selectively, less what it keeps that
    autograd saves anyway and, at most, its held outputs), and what its ends hold at the least
    (receive buffers, held outputs, sends). No partition fits when this exceeds the stages'
    memory summed: checked first, it spares the DP the points that cannot fit (a
    70B model on 16 stages)."""
    static = p.static_bytes[-1] - (p.gradient_bytes[-1] if any(p.before_gradients) else 0.0)
    activations = p.activation_bytes[-1] if min(p.in_flight, default=0) >= 1 else 0.0
    if p.selective_s is not None:
        activations -= p.selective_shared[-1] + sum(p.in_flight) * max(
            float(p.selective_held.max(initial=0.0)), 0.0)
    return float(static + activations + _least_ends_bytes(p))


def _least_ends_bytes(p: Problem) -> float:
    """What the stages' ends hold at the least: the first stage starts at cut 0 and the last
    ends at cut n; every other end sits at some inner legal cut, at best the cheapest."""
    last = p.num_stages - 1
    ends = float(p.enter_bytes[0, 0] + p.leave_bytes[last, -1])
    if not last:
        return ends
    inner = np.flatnonzero(p.legal[1:-1]) + 1  # several stages: at least one inner cut
    ends += float(p.enter_bytes[last, inner].min() + p.leave_bytes[0, inner].min())
    return ends + sum(_least_middle(p.enter_bytes[s, inner], p.leave_bytes[s, inner])
                      for s in range(1, last))


def _least_middle(enter: np.ndarray, leave: np.ndarray) -> float:
    """A middle stage's least ends: starting at an inner cut before the one it ends at (a
    span's terms split over its ends, StageRole.awaiting_weights, make the two apart far
    less)."""
    if len(enter) < 2:
        return float("inf")  # no room for a middle stage
    return float((leave[1:] + np.minimum.accumulate(enter[:-1])).min())


def _upper_bound(p: Problem, cuts: np.ndarray) -> float:
    """The bottleneck of a quick feasible partition (cuts nearest to equal shares of stage 0's
    time), or infinity when it does not fit in memory."""
    stages = p.num_stages
    shares = p.time[0, cuts] / max(float(p.time[0, -1]), 1e-300) * stages
    bounds = [0]
    for s in range(1, stages):
        # The cut nearest to s equal shares, leaving a position for each stage still to come.
        low, high = bounds[-1] + 1, len(cuts) - 1 - (stages - s)
        bounds.append(low + int(np.argmin(np.abs(shares[low:high + 1] - s))))
    bounds.append(len(cuts) - 1)
    spans = [(int(cuts[a]), int(cuts[b])) for a, b in itertools.pairwise(bounds)]
    chosen = [stage_choice(p, s, a, b) for s, (a, b) in enumerate(spans)]
    return max(c[0] if c else np.inf for c in chosen)


class _Grid:
    """Stage costs over (end, start) pairs of legal cuts, as (ends × window) arrays."""

    def __init__(self, p: Problem, cuts: np.ndarray, upper: float) -> None:
        self.p, self.cuts, self.upper = p, cuts, upper
        self.static, self.activation = p.static_bytes[cuts], p.activation_bytes[cuts]
        self.gradient, self.graph = p.gradient_bytes[cuts], p.graph_bytes[cuts]
        self.selective, self.shared = p.selective_bytes[cuts], p.selective_shared[cuts]
        self.held = p.selective_held[cuts]
        key = p.unmade_key
        self.lowest_key = np.array([-key[a:b].min() for a, b in itertools.pairwise(cuts)])
        self.working = np.array([p.working_bytes[a:b].max(initial=0.0)
                                  for a, b in itertools.pairwise(cuts)])
        self.kernels = p.kernels.between(cuts) if p.kernels.held else None
        # What any span holds at the least, recomputing or not: its weights and optimizer state
        # (static less the gradients, which a stage peaking before them may not hold yet). As
        # prefix sums it bounds how far back a span's start can reach and still fit.
        least = self.static - self.gradient
        self.least = least if bool(np.all(np.diff(least) >= 0)) else None

    def starts(self, stage: int, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per end, the starts to try (ascending, padded) and which of them are real: at least
        position ``stage``, before the end, no slower than the upper bound and holding no more
        than the stage's memory at the least (with a margin for rounding; a start too many is
        harmless)."""
        t = self.p.time[stage, self.cuts]
        slack = self.upper * (1 + 1e-9) + 1e-300
        need = t[ends] + self.p.cut_s[stage, self.cuts[ends]] - slack
        reach = (np.searchsorted(t, need, side="left") if np.isfinite(slack)
                 else np.zeros(len(ends), dtype=int))
        first = np.maximum(reach, stage)
        capacity = self.p.capacity[stage]
        if self.least is not None and np.isfinite(capacity):
            need = self.least[ends] - capacity * (1 + 1e-9) - 1e-300
            first = np.maximum(first, np.searchsorted(self.least, need, side="left"))
        width = max(int((ends - first).max()), 1)
        starts = ends[:, None] - width + np.arange(width)[None, :]
        valid = (starts >= first[:, None]) & (starts < ends[:, None])
        return np.maximum(starts, 0), valid

    def cost(self, stage: int, ends: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """Each span's time as ``stage_choice`` gives it: plain where it fits (and need not
        recompute), else the fastest recomputation that fits (or the one ``always`` names,
        where the span may), else infinite."""
        p = self.p
        plain = self.time(stage, ends, starts)
        capacity = p.capacity[stage]
        if capacity == np.inf and not (p.always and recomputations(p)):
            return plain  # everything fits, and nothing must recompute
        # What a span holds either way (weights, its ends, its largest working set), gathered
        # once; added in stage_memory's order, so that the sums round as the reference's do.
        static = self.static[ends][:, None] - self.static[starts]
        enter = p.enter_bytes[stage, self.cuts[starts]]
        leave = p.leave_bytes[stage, self.cuts[ends]][:, None]
        working = _window_max(self.working, starts)
        activations = self.activation[ends][:, None] - self.activation[starts]
        flights = p.in_flight[stage]
        unmade = self._unmade_gradients(stage, ends, starts)
        kernels = 0.0 if self.kernels is None else self.kernels[starts, ends[:, None]]
        fits = (static + flights * activations - unmade + enter + leave + working + kernels
                <= capacity)
        unrecomputable = p.unrecomputable[self.cuts]
        may = unrecomputable[ends][:, None] == unrecomputable[starts]
        cost: np.ndarray = np.where(fits, plain, np.inf)
        recomputes = may & (bool(p.always) | ~fits)
        if not recomputations(p) or not recomputes.any():
            return cost
        recomputed = np.full(fits.shape, np.inf)
        graph = self.graph[ends][:, None] - self.graph[starts]
        for mode, extra in recomputations(p):
            made, kept = activations, graph
            if mode == "selective":  # as recomputed_memory adds them
                made = activations - (self.shared[ends][:, None] - self.shared[starts])
                kept = graph + ((self.selective[ends][:, None] - self.selective[starts])
                                - self.held[ends][:, None])
            fits_mode = (static + made + flights * kept + enter + leave + working
                         + kernels <= capacity)
            slower = plain + (extra[stage, self.cuts][ends][:, None]
                              - extra[stage, self.cuts][starts])  # as stage_choice rounds
            recomputed = np.minimum(recomputed, np.where(fits_mode, slower, np.inf))
        chosen: np.ndarray = np.where(recomputes, recomputed, cost)
        return chosen

    def time(self, stage: int, ends: np.ndarray, starts: np.ndarray) -> np.ndarray:
        t = self.p.time[stage, self.cuts]
        span: np.ndarray = (t[ends][:, None] - t[starts]
                            + self.p.cut_s[stage, self.cuts[ends]][:, None])
        return span

    def _unmade_gradients(self, stage: int, ends: np.ndarray, starts: np.ndarray
                          ) -> np.ndarray | float:
        if not self.p.before_gradients[stage]:
            return 0.0
        wide_ends = np.broadcast_to(ends[:, None], starts.shape)
        lowest = (-_window_max(self.lowest_key, starts) - self.gradient[starts]
                  + self.activation[wide_ends])
        unmade: np.ndarray = np.minimum(self.gradient[wide_ends] - self.gradient[starts],
                                        lowest)
        return unmade


def _window_max(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """The largest of ``values[start:end]`` for every (end, start) of ``_Grid.starts``: each
    row's starts are consecutive and its last is end − 1, so a running maximum from the row's
    end gives them all at once (columns before a row's first valid start are masked by the
    caller)."""
    running: np.ndarray = np.maximum.accumulate(values[starts][:, ::-1], axis=1)[:, ::-1]
    return running


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
        chosen = [stage_choice(p, s, a, b) for s, (a, b) in enumerate(itertools.pairwise(bounds))]
        if any(c is None for c in chosen):
            continue
        bottleneck = max(c[0] for c in chosen if c)
        if best is None or bottleneck < best.bottleneck:
            best = Partition(bounds, bottleneck, tuple(c[1] if c else "none" for c in chosen))
    return best
