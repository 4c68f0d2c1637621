"""Plan pass: search pp × dp, micro-batch size and schedule; partition stages with the exact DP.

For every split of the devices into pp pipeline positions × dp replicas, every micro-batch size m
dividing the per-replica batch and every schedule (interleaved: v stages per device), the DP
picks the stage boundaries that minimize the slowest stage under each device's memory; the
schedule simulator then gives the iteration time. The fastest feasible candidate wins, unless
a simpler one (no interleaving, fewer stages, a larger micro-batch) is predicted within the time
model's measured error of it (``pipec.planning.choice``). The search is branch and bound
(``pipec.planning.search``); the baselines, the maximum batch and the rest live in
``pipec.planning``, one concept per module. This module is the entry point
(``plan``) and re-exports the request and result types.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

from pipec.cost.model import OPTIMIZERS, PRECISIONS
from pipec.errors import ConfigError, InfeasibleError
from pipec.frontend.annotate import CostGraph
from pipec.planning.balance import STRATEGIES, uniform_boundaries
from pipec.planning.baselines import adopt, baselines
from pipec.planning.choice import decision_margin
from pipec.planning.evaluate import (
    Evaluated,
    split_backward_s,
    stage_bwd_s,
    stage_fwd_s,
    step_terms,
    synchronized_norm_s,
    timeline,
    unlimited,
)
from pipec.planning.layouts import VIRTUAL_STAGES, fsdp_modes, layouts_to_search, points
from pipec.planning.maxbatch import MAX_BATCH_FACTOR, max_batches
from pipec.planning.points import Costs, Layout, Point
from pipec.planning.schedules import SCHEDULES, ZERO_BUBBLE
from pipec.planning.search import search
from pipec.planning.sharding import BLOCK, FSDP_MODES, SHARDED
from pipec.planning.values import (
    Baseline,
    Candidate,
    Decision,
    MaxBatch,
    Plan,
    PlanRequest,
    StagePlan,
)
from pipec.units import gib

# --recompute: where a stage must to fit, the fastest way that fits (auto), never, or every stage
# that may, in full or selectively (only the cheap operations run again).
RECOMPUTE = ("auto", "none", "full", "selective")

__all__ = [
    "FSDP_MODES",
    "MAX_BATCH_FACTOR",
    "RECOMPUTE",
    "STRATEGIES",
    "VIRTUAL_STAGES",
    "Baseline",
    "Candidate",
    "Decision",
    "MaxBatch",
    "Plan",
    "PlanRequest",
    "StagePlan",
    "check",
    "check_request",
    "plan",
    "uniform_boundaries",
]


def plan(graph: CostGraph, request: PlanRequest) -> Plan:
    """The fastest plan that fits, over pp × dp, micro-batch, schedule and stage boundaries."""
    check_request(request)
    costs = Costs(graph, request)
    layouts = layouts_to_search(costs)
    found = search(costs, points(costs, layouts), decision_margin(request))
    if found.best is None and request.boundaries is not None:
        raise _pinned_infeasible(request, found.candidates)
    if found.best is None:
        raise _infeasible(costs, layouts)
    searched = _pp_dp(found.best.layout)
    compared = baselines(costs, searched)
    chosen, decision = adopt(costs, found.fitting, compared)
    emitted = _pp_dp(chosen.layout)
    if emitted != searched:  # a simpler plan was kept: report the baselines on its layout
        searched, compared = emitted, baselines(costs, emitted)
    limit = MAX_BATCH_FACTOR * request.global_batch
    return Plan(
        request=request, pp=chosen.layout.pp, dp=chosen.layout.dp,
        micro_batch=chosen.micro_batch, num_micro_batches=chosen.num_micro_batches,
        schedule=chosen.schedule, stages=_stage_plans(costs, chosen),
        simulation=timeline(chosen), iteration_s=chosen.iteration_s,
        samples_per_s=request.global_batch / chosen.iteration_s, candidates=found.candidates,
        baselines=tuple(b.summary for b in compared),
        max_batch=max_batches(costs, searched, limit), max_batch_limit=limit,
        virtual_stages=chosen.layout.virtual, pruned=found.pruned,
        replicas_inner=chosen.layout.replicas_inner, fsdp=chosen.layout.fsdp,
        device_memory_bytes=chosen.memory, decision=decision,
        step_terms=step_terms(costs, chosen),
        synchronized_norm_s=synchronized_norm_s(chosen))


def _pp_dp(layout: Layout) -> Layout:
    """The pp × dp split and rank order of ``layout``, without its schedule's stages per
    device: where the baselines are tried."""
    return Layout(layout.pp, layout.dp, replicas_inner=layout.replicas_inner)


def check(graph: CostGraph, request: PlanRequest) -> None:
    """The user errors of ``request`` that need no planning (layouts, micro-batch, schedule),
    raised before anything slow runs (the driver measures the model after this)."""
    check_request(request)
    costs = Costs(graph, request)
    _check_boundaries(costs)
    points(costs, layouts_to_search(costs))


def _check_boundaries(costs: Costs) -> None:
    """--boundaries: increasing legal cuts inside the graph, pinning pipec's own plan."""
    pinned, n = costs.request.boundaries, len(costs.graph.nodes)
    if pinned is None:
        return
    if costs.request.strategy != "pipec":
        raise ConfigError(f"--boundaries with --strategy {costs.request.strategy}: a baseline "
                          "places its own boundaries; drop one of the two")
    if costs.request.recompute in ("full", "selective"):
        raise ConfigError(f"--boundaries with --recompute {costs.request.recompute}: a pinned "
                          "split is planned without recomputation; drop one of the two")
    if not pinned or list(pinned) != sorted(set(pinned)) or not 0 < pinned[0] <= pinned[-1] < n:
        raise ConfigError(f"--boundaries {','.join(map(str, pinned))}: give increasing node "
                          f"indices from 1 to {n - 1}, each the first node of a stage (as "
                          "plan.json's stages[].nodes gives them)")
    illegal = [b for b in pinned if not costs.legal[b]]
    if illegal:
        legal = [i for i in range(1, n) if costs.legal[i]]
        raise ConfigError(f"--boundaries: no stage may start at node {illegal[0]} (a value "
                          f"crossing there is not a tensor, or shares storage a later node "
                          f"overwrites); the legal starts nearest are "
                          f"{_nearest(legal, illegal[0])}")


def _nearest(legal: list[int], index: int) -> str:
    return ", ".join(map(str, sorted(sorted(legal, key=lambda c: abs(c - index))[:4])))


def check_request(request: PlanRequest) -> None:
    """The user errors a request shows by itself, each checked here and nowhere else."""
    _check_counts(request)
    _check_training(request)
    _check_search(request)


def _check_counts(request: PlanRequest) -> None:
    if request.gpus < 1:
        raise ConfigError(f"--gpus {request.gpus}: need at least 1 device")
    if request.nodes < 1 or request.gpus % request.nodes:
        raise ConfigError(f"--gpus {request.gpus} is not divisible by --nodes {request.nodes}; "
                          "every node runs the same number of devices")
    if request.global_batch < 1:
        raise ConfigError(f"--batch-size {request.global_batch}: must be a positive integer")
    if request.pp is not None and request.pp < 1:
        raise ConfigError(f"--pp {request.pp}: need at least 1 stage")
    if len(request.devices) != request.gpus:
        raise ConfigError(f"--hardware {request.hardware!r} lists {len(request.devices)} devices "
                          f"but --gpus is {request.gpus}; list one device per GPU")


def _check_training(request: PlanRequest) -> None:
    if request.training.optimizer not in OPTIMIZERS:
        raise ConfigError(f"--optimizer {request.training.optimizer!r}: use sgd or adamw")
    if request.training.precision not in PRECISIONS:
        raise ConfigError(f"--precision {request.training.precision!r}: use fp32 or bf16")


def _check_search(request: PlanRequest) -> None:
    if request.margin is not None and not 0 <= request.margin < 1:
        raise ConfigError(f"--margin {request.margin:.0%}: give a percentage from 0 to 99 (0: "
                          "the fastest predicted plan, however close the runner-up)")
    if request.strategy not in STRATEGIES:
        raise ConfigError(f"--strategy {request.strategy!r}: use one of {', '.join(STRATEGIES)}")
    if request.schedule != "auto" and request.schedule not in SCHEDULES:
        raise ConfigError(f"schedule {request.schedule!r} is not supported; "
                          f"use one of auto, {', '.join(SCHEDULES)}")
    if request.virtual_stages is not None and (
            request.virtual_stages < 2
            or request.schedule not in ("auto", "interleaved", "interleaved-zb", "zbv")
            or (request.schedule == "zbv" and request.virtual_stages != 2)):
        raise ConfigError(f"--virtual-stages {request.virtual_stages}: it sets the stages per "
                          "device of --schedule interleaved or interleaved-zb and must be 2 or "
                          "more (zbv always runs 2)")
    if request.schedule in ZERO_BUBBLE and request.recompute in ("full", "selective"):
        raise ConfigError(f"--schedule {request.schedule} with --recompute "
                          f"{request.recompute}: torch's zero-bubble schedules do not run "
                          "with activation recomputation; use --recompute auto (it then "
                          "recomputes nothing) or --schedule 1f1b")
    if request.fsdp not in FSDP_MODES:
        raise ConfigError(f"--fsdp {request.fsdp!r}: use one of {', '.join(FSDP_MODES)}")
    if request.fsdp in SHARDED and (request.schedule in ZERO_BUBBLE
                                    or request.schedule == "interleaved"):
        raise ConfigError(f"--fsdp {request.fsdp} with --schedule {request.schedule}: pipec "
                          "shards only stages alone on their device whose backward is whole; "
                          "use --schedule 1f1b or gpipe, or --fsdp off")
    if request.mesh not in ("auto", "dp,pp", "pp,dp"):
        raise ConfigError(f"--mesh {request.mesh!r}: use auto, dp,pp or pp,dp (outer dimension "
                          "first)")
    if request.recompute not in RECOMPUTE:
        raise ConfigError(f"--recompute {request.recompute!r}: use one of "
                          f"{', '.join(RECOMPUTE)}")


def _pinned_infeasible(request: PlanRequest, candidates: tuple[Candidate, ...]
                       ) -> InfeasibleError:
    """No point fits the split --boundaries pins: the leanest one evaluated, and the fix."""
    leanest = min(candidates, key=lambda c: c.peak_memory_bytes)
    return InfeasibleError(
        f"the split --boundaries pins does not fit: its leanest plan (micro-batch "
        f"{leanest.micro_batch}, {leanest.schedule}) needs {gib(leanest.peak_memory_bytes)} on "
        f"its fullest device on {request.hardware}; move the boundaries, or leave --boundaries "
        "out to let pipec place them within memory (recomputing where a stage must)")


def _infeasible(costs: Costs, layouts: list[Layout]) -> InfeasibleError:
    """The error when no point fits, quoting the layout that came nearest: the leanest
    setting the request allows on each (micro-batch 1 unless fixed; 1F1B unless GPipe is asked
    for or the only one that runs), and the one whose fullest device is least over."""
    request = costs.request
    sharded = [replace(layout, fsdp=mode) for layout in layouts
               for mode in fsdp_modes(costs, layout, "1f1b", layout.virtual)]
    nearest = min((_leanest(costs, layout) for layout in sharded or layouts),
                  key=lambda e: max(e.memory) - min(e.stage_costs.capacity))
    layout, micro_batch, schedule = nearest.layout, nearest.micro_batch, nearest.schedule
    usable = min(nearest.stage_costs.capacity)
    if nearest.fits() and request.schedule not in ("auto", schedule):
        return InfeasibleError(
            f"no split fits under --schedule {request.schedule} over {layout.pp} pipeline "
            f"device(s) on {request.hardware}, but {schedule} at micro-batch {micro_batch} "
            f"fits ({gib(max(nearest.memory))} on its fullest device of {gib(usable)} "
            f"usable): use --schedule {schedule} or auto")
    hint = ", --schedule 1f1b" if request.schedule == "gpipe" else ""
    recomputing = (" with recomputation where it lowers a stage's memory"
                   if request.recompute in ("auto", "full") else "")
    over = max(nearest.memory) - usable
    return InfeasibleError(
        f"no split fits: the nearest, {layout.pp} pipeline device(s) × {layout.dp} "
        f"replica(s){_sharded(layout.fsdp)} at micro-batch {micro_batch} under "
        f"{schedule}{recomputing}, needs "
        f"{gib(max(nearest.memory))} on its fullest device, {gib(over)} more than the "
        f"{gib(usable)} usable on {request.hardware}; try more --gpus, a "
        f"device with more memory (--hardware){hint} or --optimizer sgd")


def _sharded(fsdp: str) -> str:
    return {"off": "", BLOCK: " sharded a unit per block"}.get(fsdp, f" sharded ({fsdp})")


def _leanest(costs: Costs, layout: Layout) -> Evaluated:
    request = costs.request
    micro_batch = request.micro_batch or 1
    gpipe = (request.schedule == "gpipe"
             or request.global_batch // (layout.dp * micro_batch) < layout.pp)
    return unlimited(costs, Point(layout, micro_batch, "gpipe" if gpipe else "1f1b"), "time",
                     request.recompute in ("auto", "full"))


def _stage_plans(costs: Costs, e: Evaluated) -> tuple[StagePlan, ...]:
    split = split_backward_s(e)
    return tuple(_stage_plan(costs, e, k, a, b, split[k])
                 for k, (a, b) in enumerate(itertools.pairwise(e.boundaries)))


def _stage_plan(costs: Costs, e: Evaluated, k: int, a: int, b: int, split_s: float
                ) -> StagePlan:
    nodes = costs.graph.nodes[a:b]
    m, sc = e.micro_batch, e.stage_costs
    # What the stage's calls take, as train.py --metrics times them: the runtime's time between
    # actions (StageCosts.between_s) is the schedule's. A zero-bubble backward is two calls.
    fwd = stage_fwd_s(sc, k, a, b, recompute=e.recompute[k])
    bwd = stage_bwd_s(sc, k, a, b, e.recompute[k]) + split_s
    compute = fwd + bwd
    return StagePlan(
        index=k, start=a, end=b, modules=_module_names([n.module for n in nodes]),
        params=sum(n.params for n in nodes),
        fwd_flops=sum(n.fwd_flops.at(m) for n in nodes),
        bwd_flops=sum(n.bwd_flops.at(m) for n in nodes),
        activation_bytes=float(sc.arrays.activation_bytes[a:b].sum()),
        memory_bytes=e.stage_memory[k].total,
        time_s=compute + float(sc.cut_s[k, b]),
        compute_s=compute,
        boundary_bytes=(0.0 if b == len(costs.graph.nodes) else
                        costs.graph.cut_bytes_at(costs.request.training.precision)[b].at(m)),
        device=e.layout.position(k),
        fwd_s=fwd,
        bwd_s=bwd,
        memory=e.stage_memory[k],
        recompute=e.recompute[k],
    )


def _module_names(owners: list[str], depth: int = 2) -> tuple[str, ...]:
    """Distinct module names (first ``depth`` levels) in order of first appearance."""
    names: dict[str, None] = {}
    for owner in owners:
        if owner:
            names[".".join(owner.split(".")[:depth])] = None
    return tuple(names)
