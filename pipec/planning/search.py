"""Branch and bound over the points: evaluated from the smallest lower bound on their iteration
time up, stopping once the bound exceeds the best plan found (the bound is the busiest device's
share of the work at the fastest device's speed, plus the all-reduce of an equal share of the
gradients; every point's simulated time is at least that)."""

from __future__ import annotations

from dataclasses import dataclass

from pipec.costmodel import allreduce_s
from pipec.planning.costs import Costs, Point
from pipec.planning.evaluate import Evaluated, partition, rank, stage_bound_s, timed
from pipec.planning.values import Candidate
from pipec.schedule import SCHEDULES, lower_bound_s

# Bounds and simulations sum the same times in different orders: a bound is compared with this
# margin.
_MARGIN = 1 - 1e-9


@dataclass(frozen=True)
class SearchResult:
    best: Evaluated | None  # the fastest point that fits, timed; None: none fits
    candidates: tuple[Candidate, ...]  # every point evaluated, in point order
    pruned: int  # points skipped: their bound was slower than the best


def search(costs: Costs, points: list[Point]) -> SearchResult:
    """The fastest point that fits. Points that do not fit are reported (as candidates) with
    their time-balanced plan's memory and time."""
    bounds = {point: _lower_bound(costs, point) for point in points}
    ordered = sorted(points, key=lambda p: (bounds[p], point_order(p)))
    best: Evaluated | None = None
    evaluated: list[tuple[Point, Candidate]] = []
    pruned = 0
    for i, point in enumerate(ordered):
        if best is not None and bounds[point] * _MARGIN > best.iteration_s:
            pruned += len(ordered) - i
            break
        fitting = partition(costs, point, "time_within_memory")
        shown = fitting or partition(costs, point, "time")
        assert shown is not None  # without a memory limit every legal partition is allowed
        if best is not None and stage_bound_s(costs, shown) * _MARGIN > best.iteration_s:
            pruned += 1
            continue
        e = timed(costs, shown)
        evaluated.append((point, _candidate(costs, e)))
        if fitting is not None and (best is None or rank(e) < rank(best)):
            best = e
    evaluated.sort(key=lambda pc: point_order(pc[0]))
    return SearchResult(best, tuple(c for _, c in evaluated), pruned)


def point_order(point: Point) -> tuple[int, int, int, int]:
    """The order candidates are listed in (and bounds tie-break on)."""
    return (point.layout.pp, point.micro_batch, SCHEDULES.index(point.schedule),
            point.layout.virtual)


def _lower_bound(costs: Costs, point: Point) -> float:
    """No candidate is faster: the schedule's bound on the work at the fastest device's speed
    (schedule.lower_bound_s), then the all-reduce of 1/pp of the gradients over the fastest
    link."""
    layout = point.layout
    micro_batches = costs.request.global_batch // (layout.dp * point.micro_batch)
    fastest = max(costs.request.devices, key=lambda d: d.intra_node_bandwidth)
    return (lower_bound_s(costs.fastest_work_s(point.micro_batch), layout.pp, micro_batches,
                          layout.virtual)
            + allreduce_s(float(costs.param_bytes.sum()) / layout.pp, layout.dp, fastest))


def _candidate(costs: Costs, e: Evaluated) -> Candidate:
    layout = e.layout
    return Candidate(e.micro_batch, e.num_micro_batches, e.schedule,
                     costs.request.global_batch / e.iteration_s, max(e.memory), e.fits(),
                     layout.pp, layout.dp, layout.virtual)
