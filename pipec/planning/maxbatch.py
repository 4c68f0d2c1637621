"""The largest global batch each strategy trains within memory: pipec over every pp × dp it may
pick (sharded where it may shard), the partition baselines on pipec's, conventional on its own
pipeline. Each is tried in its leanest setting; the search doubles the batch, then bisects, up
to a limit."""

from __future__ import annotations

from dataclasses import replace

from pipec.planning.balance import BALANCE, STRATEGIES
from pipec.planning.evaluate import partition
from pipec.planning.layouts import conventional_layout, fsdp_modes, layouts_to_search
from pipec.planning.points import Costs, Layout, Point
from pipec.planning.schedules import runs
from pipec.planning.values import MaxBatch

# The maximum-batch search stops at this multiple of --batch-size.
MAX_BATCH_FACTOR = 64


def max_batches(costs: Costs, searched: Layout, limit: int) -> tuple[MaxBatch, ...]:
    """Per strategy (pipec first), its largest batch up to ``limit``; ``searched``: the pp × dp
    of pipec's plan, where the partition baselines are tried."""
    return tuple(_max_batch(costs, strategy, _layouts(costs, strategy, searched), limit)
                 for strategy in STRATEGIES)


def _layouts(costs: Costs, strategy: str, searched: Layout) -> list[Layout]:
    if strategy == "pipec":  # sharded where pipec may shard (the baselines never do)
        leanest = (_leanest(costs, layout) for layout in layouts_to_search(costs))
        return [layout for layout in leanest if layout is not None]
    if strategy == "conventional":
        return [conventional_layout(costs)]
    return [searched]


def _leanest(costs: Costs, layout: Layout) -> Layout | None:
    """``layout`` as it holds least: sharded where pipec may shard it (auto searches sharding
    only where it holds less, layouts.fsdp_modes), else as it is (None: the request allows
    neither, as when --fsdp is forced and the layout cannot shard)."""
    modes = fsdp_modes(costs, layout, "1f1b", 1)
    return replace(layout, fsdp=modes[-1]) if modes else None


def _batch_unit(strategy: str, layout: Layout) -> int:
    """A layout trains multiples of this: a micro-batch per replica, or for conventional its
    4 · pp micro-batches on each replica."""
    return layout.dp * (4 * layout.pp if strategy == "conventional" else 1)


def _max_batch(costs: Costs, strategy: str, layouts: list[Layout], limit: int) -> MaxBatch:
    def fits(batch: int) -> bool:
        return any(_fits_batch(costs, strategy, layout, batch)
                   for layout in layouts if batch % _batch_unit(strategy, layout) == 0)
    # Batches tried: multiples of the device count (every layout's dp divides it); conventional
    # needs 4 · pp micro-batches on each of its dp replicas.
    unit = (_batch_unit(strategy, layouts[0]) if strategy == "conventional"
            else costs.request.gpus)
    if not fits(unit):
        return MaxBatch(strategy, 0, False)
    low, high = 1, 2  # in units; low fits, high does not (or lies past the limit)
    while high * unit <= limit and fits(high * unit):
        low, high = high, high * 2
    if high * unit > limit:
        top = limit // unit
        if fits(top * unit):
            return MaxBatch(strategy, top * unit, True)  # memory does not bound it here
        high = top
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle * unit) else (low, middle)
    return MaxBatch(strategy, low * unit, False)


def _fits_batch(costs: Costs, strategy: str, layout: Layout, batch: int) -> bool:
    """Whether ``strategy`` trains a global ``batch`` in memory in its leanest configuration:
    micro-batch 1 under 1F1B (or GPipe where 1F1B is not allowed); conventional: its own."""
    pp, dp = layout.pp, layout.dp
    if strategy == "conventional":
        micro_batch, schedule = batch // (dp * 4 * pp), "gpipe"
    else:
        micro_batch = 1
        schedule = ("1f1b" if costs.request.schedule in ("auto", "1f1b")
                    and runs("1f1b", pp, batch // dp) else "gpipe")
    e = partition(costs, Point(layout, micro_batch, schedule), BALANCE[strategy], batch)
    return e is not None and e.fits()
