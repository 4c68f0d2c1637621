"""The strategies, and the rule each one places stage boundaries with (its balance).

torchgpipe's ``balance/`` has the same idea: a partition balances time, or parameters, or
nothing (equal layer counts); pipec balances time within each device's memory.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Literal

import numpy as np

from pipec.cost.stage_memory import StageRole, ends_bytes, stage_memory, working_bytes
from pipec.planning.partition import solve
from pipec.planning.points import BoundaryKey, Costs, Placement, Point
from pipec.planning.schedules import ZERO_BUBBLE
from pipec.planning.spans import Problem, make_problem

Balance = Literal["time_within_memory", "time", "parameters", "uniform", "pinned"]

# What each strategy's boundaries balance, in the order reports list the strategies.
BALANCE: dict[str, Balance] = {
    "pipec": "time_within_memory",  # the exact DP on time, under each device's memory
    "uniform": "uniform",  # equal node counts (Megatron's equal layers)
    "parameters": "parameters",  # the DP on parameter counts (DeepSpeed's default)
    "torchgpipe": "time",  # the DP on time, ignoring memory (torchgpipe's blockpartition)
    "conventional": "time",  # the study's: torchgpipe's boundaries, GPipe, M = 4 · pp
}
STRATEGIES = tuple(BALANCE)
BASELINES = STRATEGIES[1:]


def boundaries(costs: Costs, point: Point, roles: tuple[StageRole, ...], balance: Balance
               ) -> Placement | None:
    """The stage boundaries ``balance`` gives at ``point`` and which stages recompute (only
    pipec's own balance recomputes; None: nothing fits the memory). Cached in ``costs``: a rule
    without memory limits depends on fewer things than the point."""
    key = _cache_key(point, roles, balance)
    if key not in costs.boundary_cache:
        costs.boundary_cache[key] = _place(costs, point, roles, balance)
    return costs.boundary_cache[key]


def _cache_key(point: Point, roles: tuple[StageRole, ...], balance: Balance) -> BoundaryKey:
    # Only the memory limit sees sharding: the other rules share one answer across it.
    layout = point.layout if balance == "time_within_memory" else replace(point.layout,
                                                                          fsdp="off")
    key: BoundaryKey = (layout, balance)
    if balance != "uniform" and balance != "parameters":
        key += (point.micro_batch,)
    if balance == "time_within_memory":
        key += (roles, point.schedule in ZERO_BUBBLE)  # the latter: recomputation allowed
    return key


def _place(costs: Costs, point: Point, roles: tuple[StageRole, ...], balance: Balance
           ) -> Placement | None:
    plain = ("none",) * point.layout.stages
    pinned = costs.request.boundaries
    if balance == "pinned" and pinned is not None:  # --boundaries: pipec's search, pinned
        return (0, *pinned, len(costs.legal) - 1), plain
    if balance == "uniform":
        return uniform_boundaries(costs.legal, point.layout.stages), plain
    if balance == "time_within_memory" and (costs.request.recompute not in ("full", "selective")
                                            or point.schedule in ZERO_BUBBLE):
        fitting = _time_balance_if_it_fits(costs, point, roles)
        if fitting is not None:
            return fitting, plain
    partition = solve(_problem(costs, point, roles, balance))
    if partition is None:
        return None
    return partition.boundaries, partition.recompute or plain


def _time_balance_if_it_fits(costs: Costs, point: Point, roles: tuple[StageRole, ...]
                             ) -> tuple[int, ...] | None:
    """The unconstrained optimum, when it fits the memory: then it is also the constrained
    optimum, and one DP serves every schedule of the point."""
    placed = boundaries(costs, point, roles, "time")
    assert placed is not None
    bounds = placed[0]
    sc = costs.stages(point.layout, point.micro_batch)
    capacity = sc.stage_capacity(point.layout)
    for (a, b), role in zip(itertools.pairwise(bounds), roles, strict=True):
        if stage_memory(sc.arrays, a, b, role).total > capacity[role.index]:
            return None
    return bounds


def _problem(costs: Costs, point: Point, roles: tuple[StageRole, ...], balance: Balance
             ) -> Problem:
    """The DP's instance: "time_within_memory" minimizes the slowest stage under each device's
    memory; "time" ignores memory; "parameters" balances parameter counts (no memory, no links)."""
    layout = point.layout
    sc = costs.stages(layout, point.micro_batch)
    unlimited = (float("inf"),) * layout.stages
    flights = tuple(role.in_flight for role in roles)
    arrays = sc.arrays
    if balance == "parameters":
        return make_problem(costs.params, arrays.static_bytes, arrays.activation_bytes,
                            np.zeros_like(sc.cut_s), costs.legal, unlimited, flights)
    if balance == "time":
        return make_problem(sc.time_s, arrays.static_bytes, arrays.activation_bytes, sc.cut_s,
                            costs.legal, unlimited, flights)
    enter, leave = zip(*(ends_bytes(arrays, role) for role in roles), strict=True)
    # torch's zero-bubble schedules do not run with recomputation (layouts._schedules).
    mode = "none" if point.schedule in ZERO_BUBBLE else costs.request.recompute
    return make_problem(sc.time_s, arrays.static_bytes, arrays.activation_bytes, sc.cut_s,
                        costs.legal, sc.stage_capacity(layout), flights, np.stack(enter),
                        np.stack(leave), working_bytes(arrays, roles[0]), arrays.gradient_bytes,
                        tuple(role.peaks_before_gradients for role in roles),
                        sc.fwd_s if mode in ("auto", "full") else None,
                        costs.unrecomputable(layout), mode if mode in ("full", "selective")
                        else "", arrays.graph_bytes, arrays.kernels,
                        sc.selective_s if mode in ("auto", "selective") else None,
                        arrays.selective_bytes, arrays.selective_shared, arrays.selective_held)


def uniform_boundaries(legal: np.ndarray, stages: int) -> tuple[int, ...]:
    """Equal node counts per stage, each boundary moved to the nearest free legal cut."""
    n = len(legal) - 1
    cuts = [i for i in range(1, n) if legal[i]]
    chosen: list[int] = []
    for s in range(1, stages):
        free = [c for c in cuts if c not in chosen and (not chosen or c > chosen[-1])]
        # Leave enough legal cuts for the stages still to come.
        free = free[:len(free) - (stages - 1 - s)]
        chosen.append(min(free, key=lambda c: abs(c - s * n / stages)))
    return (0, *chosen, n)
