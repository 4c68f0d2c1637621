"""What a stage costs over one span of nodes: the partition DP's problem and its reference.

`pipec.planning.partition` solves the problem; these functions price one stage at a time, the
reference its vectorized grid and its brute force are checked against.

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

from dataclasses import dataclass, field

import numpy as np

from pipec.cost.kernel_cache import KernelRuns

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
    for mode, extra in recomputations(p):
        slower = plain + float(extra[stage, end] - extra[stage, start])
        if recomputed_memory(p, stage, start, end, mode) <= p.capacity[stage] and (
                best is None or slower < best[0]):
            best = (slower, mode)
    return best


def recomputations(p: Problem) -> list[tuple[str, np.ndarray]]:
    """The recomputations a stage may choose from (only the one ``always`` names, if any),
    with their prefix times."""
    return [(mode, extra) for mode, extra in (("selective", p.selective_s),
                                              ("full", p.recompute_s))
            if extra is not None and p.always in ("", mode)]


def unmade_gradients(p: Problem, stage: int, start: int, end: int) -> float:
    """For a stage peaking before its gradients, what it does not hold: G over the span, or
    less, min over its nodes i of G[start, i) + A(i, end), while node i's backward runs
    (pipec.cost.stage_memory.unmade_gradients)."""
    if not p.before_gradients[stage] or end <= start:
        return 0.0
    gradients = p.gradient_bytes[end] - p.gradient_bytes[start]
    lowest = (p.unmade_key[start:end].min() - p.gradient_bytes[start]
              + p.activation_bytes[end])
    return float(min(gradients, lowest))
