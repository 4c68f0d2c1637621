"""Branch and bound over the points: evaluated from the smallest lower bound on their iteration
time up, stopping once the bound exceeds the best plan found (the bound is the busiest device's
share of the work at the fastest device's speed, plus the all-reduce of an equal share of the
gradients; every point's simulated time is at least that; where CPU processes share cores,
pipec.cost.cores widens it)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipec.cost.model import allreduce_s
from pipec.planning.choice import candidate
from pipec.planning.evaluate import Evaluated, partition, rank, stage_bound_s, timed
from pipec.planning.points import Costs, Point
from pipec.planning.schedules import SCHEDULES
from pipec.planning.sharding import BLOCK
from pipec.planning.simulate import lower_bound_s
from pipec.planning.values import Candidate

# Bounds and simulations sum the same times in different orders: a bound is compared with this
# margin.
_MARGIN = 1 - 1e-9


@dataclass(frozen=True)
class SearchResult:
    best: Evaluated | None  # the fastest point that fits, timed; None: none fits
    candidates: tuple[Candidate, ...]  # every point evaluated, in point order
    pruned: int  # points skipped: their bound was slower than the best (widened by ``window``)
    # Every point evaluated that fits, timed (the best included): the choice's alternatives,
    # the runner-up among them.
    fitting: tuple[Evaluated, ...] = ()


def search(costs: Costs, points: list[Point], window: float = 0.0) -> SearchResult:
    """The fastest point that fits, and every fitting point evaluated: all whose lower bound
    comes within ``window`` (a fraction) of it. Points that do not fit are reported (as
    candidates) with their time-balanced plan's memory and time."""
    bounds = {point: _lower_bound(costs, point) for point in points}
    ordered = sorted(points, key=lambda p: (bounds[p], point_order(p)))
    best: Evaluated | None = None
    evaluated: list[tuple[Point, Candidate]] = []
    fitting_points: list[Evaluated] = []
    pruned = 0
    plain_fits: set[Point] = set()
    for i, point in enumerate(ordered):
        limit = float("inf") if best is None else best.iteration_s * (1 + window)
        if bounds[point] * _MARGIN > limit:
            pruned += len(ordered) - i
            break
        if _zero2_twin(point) in plain_fits:
            pruned += 1
            continue
        fitting, shown = _partitions(costs, point)
        if fitting is not None and point.layout.fsdp == "zero2" and point.layout.pp == 1 \
                and all(r == "none" for r in fitting.recompute):
            plain_fits.add(point)
        if stage_bound_s(costs, shown) * _MARGIN > limit:
            pruned += 1
            continue
        e = timed(costs, shown)
        evaluated.append((point, candidate(costs, e)))
        if fitting is not None:
            fitting_points.append(e)
            if best is None or rank(e) < rank(best):
                best = e
    evaluated.sort(key=lambda pc: point_order(pc[0]))
    return SearchResult(best, tuple(c for _, c in evaluated), pruned, tuple(fitting_points))


def _zero2_twin(point: Point) -> Point | None:
    """For a ``block`` point, the same point sharded a stage per unit. Where that one fits one
    stage without recomputing (it comes first: equal bounds keep fsdp_modes' order), the block
    point cannot win: it holds less but moves more, and with one stage there is no partition
    that its memory could balance better."""
    if point.layout.fsdp != BLOCK:
        return None
    return replace(point, layout=replace(point.layout, fsdp="zero2"))


def _partitions(costs: Costs, point: Point) -> tuple[Evaluated | None, Evaluated]:
    """pipec's partition of ``point`` where it fits (None: nothing fits), and the partition to
    show for it: that one, else the time balance ignoring memory. --boundaries pins them."""
    if costs.request.boundaries is not None:
        pinned = partition(costs, point, "pinned")
        assert pinned is not None  # the pin places its boundaries whatever they hold
        return (pinned if pinned.fits() else None), pinned
    fitting = partition(costs, point, "time_within_memory")
    shown = fitting or partition(costs, point, "time")
    assert shown is not None  # without a memory limit every legal partition is allowed
    return fitting, shown


def point_order(point: Point) -> tuple[int, int, int, int]:
    """The order candidates are listed in (and bounds tie-break on)."""
    return (point.layout.pp, point.micro_batch, SCHEDULES.index(point.schedule),
            point.layout.virtual)


def _lower_bound(costs: Costs, point: Point) -> float:
    """No candidate is faster: the schedule's bound on the work at the fastest device's speed
    (simulate.lower_bound_s), then the all-reduce of 1/pp of the gradients over the fastest
    device's fastest link (within or across nodes)."""
    layout = point.layout
    micro_batches = costs.request.global_batch // (layout.dp * point.micro_batch)
    shard = float(costs.param_bytes.sum()) / layout.pp
    fastest = min(allreduce_s(shard, layout.dp, d, inter) for d in set(costs.request.devices)
                  for inter in (False, True))
    work = costs.fastest_work_s(point.micro_batch)
    bound = lower_bound_s(work, layout.pp, micro_batches, layout.virtual, point.schedule,
                          costs.fastest_chain_s(point.micro_batch))
    cores = costs.shared_cores(layout)
    if cores is not None and cores.shared:  # in the bubbles, the others compute faster
        bound = cores.bound_s(bound, micro_batches * work / layout.pp)
    return bound + fastest
