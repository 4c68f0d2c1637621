"""The DP is exact: it finds the brute-force optimum on random instances with binding memory."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipec.cost.kernel_cache import KernelRuns
from pipec.planning.partition import brute_force, least_bytes, solve
from pipec.planning.spans import (
    make_problem,
    recomputed_memory,
    stage_choice,
    stage_memory,
    stage_time,
)


@st.composite
def problems(draw: st.DrawFn) -> tuple:
    n = draw(st.integers(2, 12))
    stages = draw(st.integers(1, min(4, n)))
    floats = st.floats(0.0, 10.0, allow_nan=False)
    # One time row for all stages (identical devices) or one per stage (mixed devices).
    rows = draw(st.sampled_from((1, stages)))
    costs = np.array([draw(st.lists(floats, min_size=n, max_size=n)) for _ in range(rows)])
    static = np.array(draw(st.lists(floats, min_size=n, max_size=n)))
    activation = np.array(draw(st.lists(floats, min_size=n, max_size=n)))
    cut_s = np.array([[0.0, *draw(st.lists(floats, min_size=n - 1, max_size=n - 1)), 0.0]
                      for _ in range(stages)])
    legal = np.array([True, *draw(st.lists(st.booleans(), min_size=n - 1, max_size=n - 1)),
                      True])
    # What a stage's ends and its largest node's working set add (buffers, loss, gradients).
    enter, leave = (np.array([draw(st.lists(floats, min_size=n + 1, max_size=n + 1))
                              for _ in range(stages)]) for _ in range(2))
    working = np.array(draw(st.lists(floats, min_size=n, max_size=n)))
    # Capacities between "almost nothing fits" and "everything fits", so memory binds often.
    total = float(static.sum() + stages * activation.sum() + 30.0)
    capacity = tuple(draw(st.floats(0.0, total + 1.0)) for _ in range(stages))
    in_flight = tuple(draw(st.integers(1, 4)) for _ in range(stages))
    # Gradients (a part of static) that a stage peaking before them does not hold.
    gradients = static * np.array(draw(st.lists(st.floats(0.0, 1.0), min_size=n, max_size=n)))
    before = tuple(draw(st.booleans()) for _ in range(stages))
    # Recomputation: not allowed, where the stage must (the fastest that fits), or always in
    # full or selectively; some nodes may not run twice.
    mode = draw(st.sampled_from(("none", "auto", "full", "selective")))
    recompute = np.array(draw(st.lists(floats, min_size=n, max_size=n))) \
        if mode in ("auto", "full") else None
    unrecomputable = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)), float)
    # The part of the activations (autograd's graph) that a recomputing stage keeps, and what
    # selective recomputation keeps besides, for what part of the forward again.
    graph = activation * np.array(draw(st.lists(st.floats(0.0, 1.0), min_size=n, max_size=n)))
    kept = activation * np.array(draw(st.lists(st.floats(0.0, 1.0), min_size=n, max_size=n)))
    shared = kept * np.array(draw(st.lists(st.floats(0.0, 1.0), min_size=n, max_size=n)))
    held = np.array(draw(st.lists(st.floats(0.0, 1.0), min_size=n + 1, max_size=n + 1)))
    selective = np.array(draw(st.lists(floats, min_size=n, max_size=n))) \
        if mode in ("auto", "selective") else None
    return make_problem(costs, static, activation, cut_s, legal, capacity, in_flight,
                        enter, leave, working, gradients, before, recompute, unrecomputable,
                        mode if mode in ("full", "selective") else "", graph,
                        draw(kernel_runs(n)), selective, kept, shared, held)


@st.composite
def kernel_runs(draw: st.DrawFn, n: int) -> KernelRuns:
    """Products and convolutions on random nodes, some calls repeated (a repeated layer's)."""
    position = sorted(draw(st.lists(st.integers(0, n - 1), max_size=2 * n)))
    call = [draw(st.integers(0, 3)) for _ in position]
    per_call = draw(st.lists(st.floats(0.0, 10.0, allow_nan=False), min_size=4, max_size=4))
    return KernelRuns.of(position, call, [per_call[c] for c in call])


def test_a_stage_holds_each_distinct_kernel_once() -> None:
    # Calls a, b, a, c on nodes 0, 1, 2, 2 (node 2 runs two): a span keeps each call's once.
    runs = KernelRuns.of([0, 1, 2, 2], ["a", "b", "a", "c"], [1.0, 2.0, 1.0, 4.0])
    assert runs.span_bytes(0, 3) == 7.0  # a, b, c
    assert runs.span_bytes(0, 2) == 3.0  # a, b
    assert runs.span_bytes(1, 3) == 7.0  # b, then a and c on node 2
    assert runs.span_bytes(2, 3) == 5.0
    assert runs.span_bytes(1, 1) == 0.0
    cuts = np.array([0, 1, 2, 3])
    matrix = runs.between(cuts)
    assert all(matrix[a, b] == runs.span_bytes(int(cuts[a]), int(cuts[b]))
               for a in range(4) for b in range(a + 1, 4))


@settings(max_examples=300, deadline=None)
@given(problems())
def test_dp_equals_brute_force(problem: object) -> None:
    dp, reference = solve(problem), brute_force(problem)  # type: ignore[arg-type]
    assert (dp is None) == (reference is None)
    if dp is not None and reference is not None:
        assert abs(dp.bottleneck - reference.bottleneck) <= 1e-9 * max(1.0, reference.bottleneck)


@settings(max_examples=300, deadline=None)
@given(problems())
def test_no_partition_holds_less_than_the_least_bytes(problem: object) -> None:
    """The bound solve() rejects a problem with before its DP: every partition's stages,
    recomputing as they choose, hold at least least_bytes() together."""
    p = problem
    unlimited = replace(p, capacity=(float("inf"),) * p.num_stages)  # type: ignore[attr-defined]
    inner = [i for i in range(1, p.num_nodes) if p.legal[i]]  # type: ignore[attr-defined]
    for cuts in itertools.combinations(inner, p.num_stages - 1):  # type: ignore[attr-defined]
        bounds = (0, *cuts, p.num_nodes)  # type: ignore[attr-defined]
        held = [min([stage_memory(unlimited, s, a, b)] + [
            recomputed_memory(unlimited, s, a, b, mode) for mode in ("full", "selective")
            if (unlimited.recompute_s if mode == "full" else unlimited.selective_s) is not None])
            for s, (a, b) in enumerate(itertools.pairwise(bounds))]
        assert least_bytes(unlimited) <= sum(held) + 1e-9 * max(1.0, sum(held))


@settings(max_examples=200, deadline=None)
@given(problems())
def test_dp_partition_is_valid_and_achieves_its_bottleneck(problem: object) -> None:
    p = problem
    result = solve(p)  # type: ignore[arg-type]
    if result is None:
        return
    bounds = result.boundaries
    assert bounds[0] == 0 and bounds[-1] == p.num_nodes  # type: ignore[attr-defined]
    assert all(a < b for a, b in itertools.pairwise(bounds))
    assert all(p.legal[b] for b in bounds)  # type: ignore[attr-defined]
    spans = list(itertools.pairwise(bounds))
    chosen = [stage_choice(p, s, a, b) for s, (a, b) in enumerate(spans)]  # type: ignore[arg-type]
    assert all(c is not None for c in chosen)
    assert tuple(c[1] for c in chosen if c) == result.recompute
    for s, (a, b) in enumerate(spans):
        mode = result.recompute[s]
        held = stage_memory(p, s, a, b) if mode == "none" else recomputed_memory(  # type: ignore[arg-type]
            p, s, a, b, mode)  # type: ignore[arg-type]
        assert held <= p.capacity[s]  # type: ignore[attr-defined]
        slower = mode != "none"
        assert (chosen[s][0] >= stage_time(p, s, a, b)) if slower else (  # type: ignore[index, arg-type]
            chosen[s][0] == stage_time(p, s, a, b))  # type: ignore[index, arg-type]
    assert max(c[0] for c in chosen if c) == result.bottleneck


def test_balanced_chain_is_split_evenly() -> None:
    n = 8
    problem = make_problem(np.ones(n), np.zeros(n), np.zeros(n), np.zeros(n + 1),
                           np.ones(n + 1, bool), (1.0,) * 4, (1,) * 4)
    result = solve(problem)
    assert result is not None
    assert result.boundaries == (0, 2, 4, 6, 8) and result.bottleneck == 2.0


def test_memory_limit_moves_the_boundary() -> None:
    # Node 0 is heavy in memory: a stage may hold it only alone.
    static = np.array([5.0, 1.0, 1.0, 1.0])
    problem = make_problem(np.array([1.0, 1.0, 1.0, 1.0]), static, np.zeros(4), np.zeros(5),
                           np.ones(5, bool), (5.0, 10.0), (1, 1))
    result = solve(problem)
    assert result is not None and result.boundaries == (0, 1, 4)


def test_a_slower_device_gets_less_work() -> None:
    # Stage 1's device is three times slower: the balanced split gives it a quarter of the work.
    n = 8
    costs = np.stack([np.ones(n), np.full(n, 3.0)])
    problem = make_problem(costs, np.zeros(n), np.zeros(n), np.zeros(n + 1), np.ones(n + 1, bool),
                           (1.0, 1.0), (1, 1))
    result = solve(problem)
    assert result is not None and result.boundaries == (0, 6, 8) and result.bottleneck == 6.0


def test_no_partition_fits() -> None:
    problem = make_problem(np.ones(3), np.full(3, 2.0), np.zeros(3), np.zeros(4),
                           np.ones(4, bool), (1.0, 1.0), (1, 1))
    assert solve(problem) is None and brute_force(problem) is None


def test_a_stage_recomputes_only_where_it_must() -> None:
    """Two stages, each one node's activations too large to keep twice: the second recomputes
    (its forward again: +0.5), the first, which fits, does not; a node that must not run twice
    keeps its stage from recomputing."""
    problem = make_problem(np.ones(4), np.zeros(4), np.array([1.0, 1.0, 4.0, 1.0]),
                           np.zeros(5), np.array([True, False, True, False, True]),
                           (4.0, 5.0), (2, 2), recompute=np.full(4, 0.5))
    result = solve(problem)
    assert result is not None and result.recompute == ("none", "full")
    assert result.bottleneck == 3.0
    stuck = make_problem(np.ones(4), np.zeros(4), np.array([1.0, 1.0, 4.0, 1.0]), np.zeros(5),
                         np.array([True, False, True, False, True]), (4.0, 5.0), (2, 2),
                         recompute=np.full(4, 0.5), unrecomputable=np.array([0, 0, 0, 1.0]))
    assert solve(stuck) is None


def test_a_stage_recomputes_selectively_where_that_fits() -> None:
    """As above, with selective recomputation allowed too (0.1 per node again): the second
    stage keeps nothing more per micro-batch in flight and fits selectively (2 + 0.2); keeping
    0.5 of its third node's for each of its 2 micro-batches it holds 6 > 5 and recomputes in
    full (2 + 1.0)."""
    def solved(kept: list[float]) -> tuple[tuple[str, ...], float]:
        problem = make_problem(np.ones(4), np.zeros(4), np.array([1.0, 1.0, 4.0, 1.0]),
                               np.zeros(5), np.array([True, False, True, False, True]),
                               (4.0, 5.0), (2, 2), recompute=np.full(4, 0.5),
                               selective=np.full(4, 0.1), selective_bytes=np.array(kept))
        result = solve(problem)
        assert result is not None and brute_force(problem) == result
        return result.recompute, result.bottleneck
    assert solved([0.0, 0.0, 0.0, 0.0]) == (("none", "selective"), pytest.approx(2.2))
    assert solved([0.0, 0.0, 0.5, 0.0]) == (("none", "full"), 3.0)


def test_the_dp_adds_memory_in_the_reference_order() -> None:
    """At the capacity exactly, the sum's rounding decides: 0.1 + 0.1 + 1.1 is 1.3 in the
    scalar reference's order and 1.3000000000000003 in another; the DP must agree with it."""
    problem = make_problem(np.ones(1), np.array([0.1]), np.array([0.1]), np.zeros(2),
                           np.array([True, True]), (1.3,), (1,), enter=np.array([[1.1, 0.0]]),
                           recompute=np.ones(1))
    assert brute_force(problem) is not None and solve(problem) is not None
