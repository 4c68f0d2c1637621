"""The search space: the pp × dp layouts, micro-batch sizes, schedules and stages per device
that the request allows, checked against the devices, the batch and the model's legal cuts."""

from __future__ import annotations

from pipec.cost.model import static_ratio
from pipec.errors import ConfigError
from pipec.frontend.normalization import resolve_norm
from pipec.planning.points import Costs, Layout, Point
from pipec.planning.schedules import SCHEDULES, ZERO_BUBBLE, runs
from pipec.planning.sharding import BLOCK, SHARDED, sharded_static_ratio
from pipec.planning.values import PlanRequest

# Interleaved 1F1B: the stages per device searched when --virtual-stages is not given.
VIRTUAL_STAGES = (2, 3, 4)
# Interleaved zero bubble: the weights' gradients already fill the bubble at 2 stages per
# device; more would add only sends and runtime actions.
VIRTUAL_STAGES_ZERO_BUBBLE = (2,)


def layouts_to_search(costs: Costs) -> list[Layout]:
    """The pp × dp layouts to search: the one --pp gives, or every pp dividing the device count
    whose dp divides the batch and that the model's legal cuts allow."""
    request = costs.request
    if request.pp is not None:
        return [layout_for_pp(costs, request.pp)]
    layouts = [Layout(pp, request.gpus // pp) for pp in range(1, request.gpus + 1)
               if request.gpus % pp == 0 and pp <= costs.max_stages
               and request.global_batch % (request.gpus // pp) == 0]
    if not layouts:
        raise ConfigError(f"--batch-size {request.global_batch} is not divisible by any "
                          f"data-parallel degree of {request.gpus} devices that this model's "
                          f"{costs.max_stages} possible stages allow; use a multiple of "
                          f"{request.gpus}")
    return layouts


def layout_for_pp(costs: Costs, pp: int) -> Layout:
    """The layout of ``pp`` pipeline devices, the rest data parallel; a ConfigError when the
    devices, the batch or the model's legal cuts do not allow it."""
    request = costs.request
    if request.gpus % pp:
        raise ConfigError(f"--pp {pp} does not divide --gpus {request.gpus}; "
                          "pipeline stages × data-parallel replicas must equal the device count")
    dp = request.gpus // pp
    if request.global_batch % dp:
        raise ConfigError(f"--batch-size {request.global_batch} is not divisible by the "
                          f"{dp} data-parallel replicas; use a multiple of {dp}")
    if pp > costs.max_stages:
        raise ConfigError(f"the model has {len(costs.graph.nodes)} nodes and only "
                          f"{costs.max_stages - 1} legal stage boundaries, so at most "
                          f"{costs.max_stages} stages; use --pp {costs.max_stages} or less")
    return Layout(pp, dp)


def conventional_layout(costs: Costs) -> Layout:
    """The study's conventional setup: one pipeline over every device (or --pp's)."""
    request = costs.request
    pp = request.pp or max(p for p in range(1, min(request.gpus, costs.max_stages) + 1)
                           if request.gpus % p == 0
                           and request.global_batch % (request.gpus // p) == 0)
    return Layout(pp, request.gpus // pp, replicas_inner=request.mesh == "pp,dp")


def points(costs: Costs, layouts: list[Layout]) -> list[Point]:
    """Every point of ``layouts`` that the request allows and torch's schedules run."""
    request = costs.request
    found = []
    for layout in layouts:
        pp, dp = layout.pp, layout.dp
        replica_batch = request.global_batch // dp
        for m in micro_batch_sizes(request, replica_batch):
            for schedule in _schedules(request):
                found += [Point(Layout(pp, dp, v, schedule == "zbv", inner, fsdp), m, schedule)
                          for v in _virtual_stages(costs, schedule, pp)
                          for inner in _rank_orders(request, layout)
                          for fsdp in fsdp_modes(costs, layout, schedule, v)
                          if runs(schedule, pp, replica_batch // m, v)]
    if request.boundaries is not None:
        found = pinned_points(request, found)
    if not found and request.fsdp in SHARDED:
        raise _no_sharding(request, layouts)
    if not found:
        raise _no_schedule(request, layouts[-1].pp)
    return found


def pinned_points(request: PlanRequest, found: list[Point]) -> list[Point]:
    """Of ``found``, the points with as many stages as --boundaries pins; a ConfigError when
    none has."""
    assert request.boundaries is not None
    stages = len(request.boundaries) + 1
    kept = [p for p in found if p.layout.stages == stages]
    if found and not kept:
        counts = sorted({p.layout.stages for p in found})
        allowed = " or ".join(map(str, counts)) + (" stage" if counts == [1] else " stages")
        raise ConfigError(f"--boundaries gives {stages - 1} boundaries, so {stages} stages, "
                          f"but the plans --pp, --schedule and --virtual-stages allow have "
                          f"{allowed}; give one boundary fewer than the stages (pp × virtual "
                          "stages per device)")
    return kept


def fsdp_modes(costs: Costs, layout: Layout, schedule: str, virtual: int) -> tuple[str, ...]:
    """The sharding searched at a point (pipec.planning.sharding): only with replicas to shard over,
    one stage per device (FSDP units must not share a parameter, as a device's stages may) and
    a full backward (torch's zero-bubble schedules make the weights' gradients apart); never
    where plain BatchNorm is kept across replicas (FSDP, unlike DDP, does not broadcast the
    running statistics). ``auto`` searches zero2 where it holds less than DDP (SGD on 2
    replicas holds as much: its bytes move alike, and a more complex plan must win by the
    margin); zero3 holds as much as zero2 at the peak; ``block`` (a unit per block, gradients
    reduce-scattered per micro-batch) where the model has blocks, the least memory and the
    most collectives."""
    request = costs.request
    if (layout.dp == 1 or virtual > 1 or schedule in ZERO_BUBBLE
            or (resolve_norm(request.norm, layout.pp, layout.dp) == "keep"
                and costs.graph_has_batch_norm)):
        return () if request.fsdp in SHARDED else ("off",)
    if request.fsdp == BLOCK and not costs.largest_block_bytes:
        raise ConfigError("--fsdp block: the model has no blocks (modules under a numbered "
                          "path, such as layers.0, that hold parameters and run once a "
                          "forward); use --fsdp zero2 or zero3")
    if request.fsdp != "auto":
        return (request.fsdp,)
    lighter = (sharded_static_ratio(request.training, layout.dp)
               < static_ratio(request.training))
    if not lighter:
        return ("off",)
    return ("off", "zero2", BLOCK) if costs.largest_block_bytes else ("off", "zero2")


def _no_sharding(request: PlanRequest, layouts: list[Layout]) -> ConfigError:
    replicas = ", ".join(str(layout.dp) for layout in layouts)
    return ConfigError(f"--fsdp {request.fsdp} shards each stage over its data-parallel "
                       f"replicas, with one stage per device and a schedule without a split "
                       f"backward (gpipe or 1f1b); the layouts searched have {replicas} "
                       "replica(s). Use a --pp below --gpus, --schedule 1f1b or gpipe, or "
                       "--fsdp off")


def _no_schedule(request: PlanRequest, pp: int) -> ConfigError:
    if request.schedule in ("interleaved", "interleaved-zb"):
        return ConfigError(f"--schedule {request.schedule} needs 2 or more pipeline devices and "
                           f"a multiple of {pp} micro-batches per step, with {pp} × "
                           "--virtual-stages stages the model can be cut into; use a smaller "
                           "--micro-batch, another --pp or --schedule 1f1b")
    if request.schedule == "zbv":
        return ConfigError(f"--schedule zbv needs 2 or more pipeline devices and 2 × {pp} "
                           "stages the model can be cut into; use another --pp or --schedule "
                           "1f1b")
    return ConfigError(f"--schedule {request.schedule} needs at least {pp} micro-batches per "
                       f"step (one per stage); use a smaller --micro-batch or --schedule gpipe")


def micro_batch_sizes(request: PlanRequest, replica_batch: int) -> list[int]:
    """The one --micro-batch gives (checked), or every divisor of the replica's batch."""
    if request.micro_batch is None:
        return [m for m in range(1, replica_batch + 1) if replica_batch % m == 0]
    if request.micro_batch < 1 or replica_batch % request.micro_batch:
        raise ConfigError(f"--micro-batch {request.micro_batch} does not divide the per-replica "
                          f"batch {replica_batch}; pick a divisor of {replica_batch}")
    return [request.micro_batch]


def _rank_orders(request: PlanRequest, layout: Layout) -> tuple[bool, ...]:
    """Whether a position's replicas sit on neighbouring ranks (True) or a replica's positions
    (False): which links the pipeline and the all-reduce use differs only across nodes."""
    if request.mesh != "auto":
        return (request.mesh == "pp,dp",)
    both = request.nodes > 1 and layout.pp > 1 and layout.dp > 1
    return (False, True) if both else (False,)


def _schedules(request: PlanRequest) -> tuple[str, ...]:
    """The schedules searched: torch runs no zero-bubble schedule with recomputation (the
    weights' gradient would need the activations recomputation dropped)."""
    if request.schedule != "auto":
        return (request.schedule,)
    return tuple(s for s in SCHEDULES
                 if request.recompute not in ("full", "selective") or s not in ZERO_BUBBLE)


def _virtual_stages(costs: Costs, schedule: str, pp: int) -> tuple[int, ...]:
    if schedule == "zbv":
        fixed = costs.request.virtual_stages in (None, 2)
        return (2,) if fixed and 2 * pp <= costs.max_stages else ()
    if schedule not in ("interleaved", "interleaved-zb"):
        return (1,)
    options = ((costs.request.virtual_stages,) if costs.request.virtual_stages
               else VIRTUAL_STAGES if schedule == "interleaved" else VIRTUAL_STAGES_ZERO_BUBBLE)
    return tuple(v for v in options if pp * v <= costs.max_stages)
