"""The baselines' plans, by the same cost model and simulator as pipec's, and the choice of the
plan to emit: a baseline's (--strategy), or pipec's choice among its own plans and the feasible
baselines (the fastest, unless a simpler one is within the decision margin)."""

from __future__ import annotations

from dataclasses import dataclass

from pipec.errors import InfeasibleError
from pipec.planning.balance import BALANCE, BASELINES
from pipec.planning.choice import choose
from pipec.planning.evaluate import Evaluated, rank, unlimited
from pipec.planning.layouts import conventional_layout, micro_batch_sizes
from pipec.planning.points import Costs, Layout, Point
from pipec.planning.schedules import runs
from pipec.planning.values import Baseline, Decision, PlanRequest
from pipec.units import gib


@dataclass(frozen=True)
class BaselinePlan:
    summary: Baseline
    evaluated: Evaluated


def baselines(costs: Costs, searched: Layout) -> tuple[BaselinePlan, ...]:
    """Each baseline strategy's plan: on pipec's pp × dp (``searched``), conventional on its
    own pipeline."""
    return tuple(_baseline(costs, conventional_layout(costs) if strategy == "conventional"
                           else searched, strategy) for strategy in BASELINES)


def _baseline(costs: Costs, layout: Layout, strategy: str) -> BaselinePlan:
    """A baseline on the given pp × dp: its balance, and the best micro-batch and schedule for
    its boundaries (the fastest that fits, else the fastest); `conventional` is the study's:
    torchgpipe's time balance, GPipe, M = 4 · pp micro-batches, on one pipeline."""
    request = costs.request
    replica_batch = request.global_batch // layout.dp
    balance = BALANCE[strategy]
    if strategy == "conventional":
        point = Point(layout, _conventional_micro_batch(replica_batch, layout.pp), "gpipe")
        tried = [unlimited(costs, point, balance)]
    else:
        tried = [unlimited(costs, Point(layout, m, schedule), balance)
                 for m in micro_batch_sizes(request, replica_batch)
                 for schedule in ("gpipe", "1f1b") if runs(schedule, layout.pp, replica_batch // m)]
    fitting = [e for e in tried if e.fits()]
    e = min(fitting or tried, key=rank)
    return BaselinePlan(Baseline(strategy, e.micro_batch, e.schedule,
                                 request.global_batch / e.iteration_s, bool(fitting)), e)


def _conventional_micro_batch(replica_batch: int, pp: int) -> int:
    """The largest divisor of the replica's batch at most replica_batch / (4 · pp): about
    4 · pp micro-batches, as the study's conventional pipelining runs."""
    micro_batch = max(1, replica_batch // (4 * pp))
    while replica_batch % micro_batch:
        micro_batch -= 1
    return micro_batch


def adopt(costs: Costs, searched: tuple[Evaluated, ...], plans: tuple[BaselinePlan, ...]
          ) -> tuple[Evaluated, Decision | None]:
    """The plan to emit: a baseline's when asked (--strategy), else pipec's choice among its
    search's plans that fit (``searched``) and the feasible baselines within what
    the user fixed (--micro-batch, --schedule, --pp): a baseline that simulates faster wins,
    unless a simpler plan is predicted within the decision margin of it (pipec.planning.choice)."""
    request = costs.request
    strategy = request.strategy
    if strategy != "pipec":
        chosen = next(p for p in plans if p.summary.strategy == strategy)
        if not chosen.summary.feasible:
            raise InfeasibleError(f"--strategy {strategy} does not fit: it needs "
                                  f"{gib(max(chosen.evaluated.memory))} on its fullest "
                                  "device; use --strategy pipec or more devices")
        return chosen.evaluated, None
    alternatives = [*searched, *(p.evaluated for p in plans
                             if p.summary.feasible and _allowed(p.evaluated, request)
                             and request.boundaries is None)]  # --boundaries: pipec's own
    return choose(costs, min(alternatives, key=rank), alternatives)


def _allowed(e: Evaluated, request: PlanRequest) -> bool:
    """Whether ``e`` keeps what the user fixed (a baseline never recomputes nor shards)."""
    mesh = "pp,dp" if e.layout.replicas_inner else "dp,pp"
    return (request.micro_batch in (None, e.micro_batch) and request.pp in (None, e.layout.pp)
            and request.schedule in ("auto", e.schedule)
            and request.recompute not in ("full", "selective")
            and request.mesh in ("auto", mesh) and request.fsdp in ("auto", "off"))
