"""Exact dynamic programming over contiguous stages: minimize the slowest stage under memory.

Pure numbers in, numbers out (numpy, no torch), so it can be checked against brute force.

Legend: n nodes in topological order; a stage covers nodes [j, i) and is cut at j and i;
``time[s, i] - time[s, j]`` is its compute time on stage s's device (devices may differ),
``cut_s[s, i]`` the cost of stage s sending its output (per stage, since the link to the next
stage may be inter-node);
stage s holds its static bytes once and its activation bytes ``in_flight[s]`` times, plus what
its ends cost it (``enter_bytes[s, j]``: receive buffers for its input at cut j;
``leave_bytes[s, i]``: buffers for the gradients of its output at cut i, outputs kept for their
backward, the loss) and the largest working set among its nodes (``working_bytes``: the
gradients alive while one node's backward runs).

Activation recomputation (``recompute_s``): a stage may keep only its inputs for backward and
run its forward again there. It then holds one micro-batch's activations (while it recomputes)
instead of ``in_flight[s]`` of them, and its time grows by its forward. Selective recomputation
(``selective_s``) keeps, per micro-batch in flight, the outputs of the expensive operations
(``selective_bytes``) and runs only the others again. A stage takes the fastest of plain,
selective and full that fits (or, with ``always``, the mode named there wherever it may),
unless one of its nodes must not run twice (``unrecomputable``). Each stage's choice depends
only on its own span, so the DP stays exact.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from pipec.kernelruns import KernelRuns

# A stage's recomputation (plan.json stages[k].recompute).
RECOMPUTE_MODES = ("none", "selective", "full")


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
    enter_bytes: np.ndarray  # (num_stages, n + 1): held by a stage that starts at the cut
    leave_bytes: np.ndarray  # (num_stages, n + 1): held by a stage that ends at the cut
    working_bytes: np.ndarray  # (n,): transient bytes while the node runs; a stage the largest
    # Prefix sums of the gradients (part of static_bytes), and per stage whether its peak comes
    # before them: then it holds min(gradients, one micro-batch's activations) less.
    gradient_bytes: np.ndarray = field(default_factory=lambda: np.zeros(1))
    before_gradients: tuple[bool, ...] = ()
    # (num_stages, n + 1) prefix sums of what recomputing costs (each node's forward again);
    # None: no stage recomputes.
    recompute_s: np.ndarray | None = None
    # Prefix counts of the nodes a recomputing stage must not hold (they would run twice).
    unrecomputable: np.ndarray = field(default_factory=lambda: np.zeros(1))
    # "full" or "selective": every stage that may recomputes so, fitting or not ("": where it
    # must).
    always: str = ""
    # Prefix sums of the part of activation_bytes that a recomputing stage still holds per
    # micro-batch in flight (autograd's graph, on a CPU).
    graph_bytes: np.ndarray = field(default_factory=lambda: np.zeros(1))
    kernels: KernelRuns = field(default_factory=KernelRuns)
    # (num_stages, n + 1) prefix sums of what selective recomputation costs (the forward of the
    # operations it does not keep), and prefix sums of what it keeps per micro-batch in flight;
    # None: no stage recomputes selectively.
    selective_s: np.ndarray | None = None
    selective_bytes: np.ndarray = field(default_factory=lambda: np.zeros(1))
    # Prefix sums of what it keeps that autograd saves anyway (the recomputed micro-batch does
    # not make it again), and per cut what it keeps of a stage's outputs ending there, which
    # the stage's ``leave_bytes`` hold anyway.
    selective_shared: np.ndarray = field(default_factory=lambda: np.zeros(1))
    selective_held: np.ndarray = field(default_factory=lambda: np.zeros(1))

    @property
    def unmade_key(self) -> np.ndarray:
        """Per node i, G[0, i) − A[0, i]: a span's G[start, i) + A(i, end) is this plus
        A[0, end) − G[0, start), so the span's least is a range minimum."""
        key: np.ndarray = self.gradient_bytes[:-1] - self.activation_bytes[1:]
        return key

    @property
    def num_nodes(self) -> int:
        return int(self.time.shape[1]) - 1

    @property
    def num_stages(self) -> int:
        return len(self.capacity)


@dataclass(frozen=True)
class Partition:
    boundaries: tuple[int, ...]  # num_stages + 1 cuts, 0 first and n last
    bottleneck: float  # the slowest stage's time
    recompute: tuple[str, ...] = ()  # per stage: one of RECOMPUTE_MODES


def make_problem(costs: np.ndarray, static: np.ndarray, activation: np.ndarray,
                 cut_s: np.ndarray, legal: np.ndarray, capacity: tuple[float, ...],
                 in_flight: tuple[int, ...], enter: np.ndarray | None = None,
                 leave: np.ndarray | None = None, working: np.ndarray | None = None,
                 gradients: np.ndarray | None = None,
                 before_gradients: tuple[bool, ...] | None = None,
                 recompute: np.ndarray | None = None, unrecomputable: np.ndarray | None = None,
                 always: str = "", graph: np.ndarray | None = None,
                 kernels: KernelRuns | None = None, selective: np.ndarray | None = None,
                 selective_bytes: np.ndarray | None = None,
                 selective_shared: np.ndarray | None = None,
                 selective_held: np.ndarray | None = None) -> Problem:
    """Build a Problem from per-node arrays (length n) and per-cut arrays (length n + 1).

    ``costs``, ``cut_s``, ``enter``, ``leave``, ``recompute`` and ``selective`` (each node's
    cost of running again, in full or selectively) are one row for all stages or one row per
    stage; the memory terms default to zero.
    """
    def prefix(values: np.ndarray) -> np.ndarray:
        values = np.asarray(values, float)
        return np.concatenate((np.zeros((*values.shape[:-1], 1)),
                               np.cumsum(values, axis=-1)), axis=-1)
    n, stages = np.shape(costs)[-1], len(capacity)
    def per_stage(values: np.ndarray | None) -> np.ndarray:
        return np.broadcast_to(np.asarray(0.0 if values is None else values, float),
                               (stages, n + 1))
    time = np.broadcast_to(prefix(costs), (stages, n + 1))
    return Problem(time, per_stage(cut_s), prefix(static), prefix(activation),
                   np.asarray(legal, bool), capacity, in_flight, per_stage(enter),
                   per_stage(leave), np.zeros(n) if working is None else np.asarray(working, float),
                   prefix(np.zeros(n) if gradients is None or not len(gradients) else gradients),
                   before_gradients or (False,) * stages,
                   None if recompute is None else np.broadcast_to(prefix(recompute),
                                                                  (stages, n + 1)),
                   prefix(np.zeros(n) if unrecomputable is None else unrecomputable),
                   always, prefix(np.zeros(n) if graph is None or not len(graph) else graph),
                   kernels or KernelRuns(),
                   None if selective is None else np.broadcast_to(prefix(selective),
                                                                  (stages, n + 1)),
                   prefix(_or_zeros(selective_bytes, n)), prefix(_or_zeros(selective_shared, n)),
                   _or_zeros(selective_held, n + 1))


def _or_zeros(values: np.ndarray | None, length: int) -> np.ndarray:
    return np.zeros(length) if values is None or not len(values) else np.asarray(values, float)


def stage_time(p: Problem, stage: int, start: int, end: int) -> float:
    return float(p.time[stage, end] - p.time[stage, start] + p.cut_s[stage, end])


def stage_memory(p: Problem, stage: int, start: int, end: int) -> float:
    activations = p.activation_bytes[end] - p.activation_bytes[start]
    return float(p.static_bytes[end] - p.static_bytes[start] + p.in_flight[stage] * activations
                 - unmade_gradients(p, stage, start, end) + p.enter_bytes[stage, start]
                 + p.leave_bytes[stage, end] + p.working_bytes[start:end].max(initial=0.0)
                 + p.kernels.span_bytes(start, end))


def recomputed_memory(p: Problem, stage: int, start: int, end: int,
                      mode: str = "full") -> float:
    """The stage's memory when it recomputes: one micro-batch's activations (those it makes
    again in its backward, with their graph) and, per micro-batch in flight, the graph and
    (selective) what it keeps; no gradient left unmade."""
    activations = p.activation_bytes[end] - p.activation_bytes[start]
    kept = p.graph_bytes[end] - p.graph_bytes[start]
    if mode == "selective":
        activations = activations - (p.selective_shared[end] - p.selective_shared[start])
        kept = kept + ((p.selective_bytes[end] - p.selective_bytes[start])
                       - p.selective_held[end])
    return float(p.static_bytes[end] - p.static_bytes[start] + activations
                 + p.in_flight[stage] * kept
                 + p.enter_bytes[stage, start] + p.leave_bytes[stage, end]
                 + p.working_bytes[start:end].max(initial=0.0) + p.kernels.span_bytes(start, end))


def stage_choice(p: Problem, stage: int, start: int, end: int) -> tuple[float, str] | None:
    """The stage's time and recomputation (RECOMPUTE_MODES), or None when it fits no way."""
    plain = stage_time(p, stage, start, end)
    fits = stage_memory(p, stage, start, end) <= p.capacity[stage]
    may = p.unrecomputable[end] == p.unrecomputable[start]
    if not may or (fits and not p.always):
        return (plain, "none") if fits else None
    # The fastest recomputation that fits (the first of equals), or the one ``always`` names.
    best: tuple[float, str] | None = None
    for mode, extra in _recomputations(p):
        slower = plain + float(extra[stage, end] - extra[stage, start])
        if recomputed_memory(p, stage, start, end, mode) <= p.capacity[stage] and (
                best is None or slower < best[0]):
            best = (slower, mode)
    return best


def _recomputations(p: Problem) -> list[tuple[str, np.ndarray]]:
    """The recomputations a stage may choose from (only the one ``always`` names, if any),
    with their prefix times."""
    return [(mode, extra) for mode, extra in (("selective", p.selective_s),
                                              ("full", p.recompute_s))
            if extra is not None and p.always in ("", mode)]


def unmade_gradients(p: Problem, stage: int, start: int, end: int) -> float:
    """For a stage peaking before its gradients, what it does not hold: G over the span, or
    less, min over its nodes i of G[start, i) + A(i, end), while node i's backward runs
    (pipec.stagememory.unmade_gradients)."""
    if not p.before_gradients[stage] or end <= start:
        return 0.0
    gradients = p.gradient_bytes[end] - p.gradient_bytes[start]
    lowest = (p.unmade_key[start:end].min() - p.gradient_bytes[start]
              + p.activation_bytes[end])
    return float(min(gradients, lowest))


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
        if capacity == np.inf and not (p.always and _recomputations(p)):
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
        if not _recomputations(p) or not recomputes.any():
            return cost
        recomputed = np.full(fits.shape, np.inf)
        graph = self.graph[ends][:, None] - self.graph[starts]
        for mode, extra in _recomputations(p):
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
