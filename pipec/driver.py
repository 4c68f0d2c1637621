"""compile_model(): the pass list, one line per pass."""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields, replace
from pathlib import Path

from pipec.calibration import MEASURE_CHOICES, measure_locally
from pipec.codegen import (
    Emitted,
    SequenceParallelError,
    emit,
    export_stages,
    require_onnx,
    sequence_split,
    split,
)
from pipec.cost import Device, Training, load_calibration, load_devices
from pipec.cost.hardware import DEFAULT
from pipec.errors import ConfigError
from pipec.frontend import (
    CostGraph,
    ModelSpec,
    Traced,
    annotate,
    load_model_file,
    plan_norms,
    trace_model,
)
from pipec.frontend.normalization import with_functional_group_norms
from pipec.frontend.shardable import Shardable, find_shardable
from pipec.planning import Plan, PlanRequest, check, check_request, plan
from pipec.planning.tp_search import (
    SequenceSplit,
    fastest_at,
    plan_with_tp,
    tp_degrees,
    tp_groups,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompileOptions:
    """``pipec compile``'s options, one field per flag under the flag's argparse name (the
    command line maps onto it by name); the fields a ``PlanRequest`` shares pass on by name."""

    model: Path
    out: Path = Path("out")
    gpus: int = 1
    nodes: int = 1
    batch_size: int = 32
    hardware: str = DEFAULT
    pp: int | None = None
    micro_batch: int | None = None
    schedule: str = "auto"
    norm: str = "auto"
    norm_groups: int | None = None
    recompute: str = "auto"
    mesh: str = "auto"  # "auto", "dp,pp" or "pp,dp": outer dimension first
    fsdp: str = "auto"  # "auto", "off", "zero2", "zero3" or "block"
    optimizer: str = "sgd"
    precision: str = "fp32"
    calibration: Path | None = None
    measure: str = "auto"  # "auto": time the model here when the devices are this machine's
    strategy: str = "pipec"
    virtual_stages: int | None = None
    boundaries: tuple[int, ...] | None = None  # pinned: each later stage's first node
    margin: float | None = None  # a fraction; None: the time model's measured error
    frontend: str = "auto"
    tp: str = "1"  # tensor-parallel ranks per stage replica: a positive integer, or "auto"
    # Under tp: "auto" (planned with and without, the faster kept), "on" or "off".
    sequence_parallel: str = "auto"
    onnx: bool = False
    force: bool = False


@dataclass(frozen=True)
class Analyzed:
    """What the passes before planning produce."""

    spec: ModelSpec
    traced: Traced
    graph: CostGraph
    request: PlanRequest


def analyze(options: CompileOptions) -> Analyzed:
    request = _request(options)
    spec = load_model_file(options.model)
    traced = trace_model(spec, options.frontend, _device_type(request.devices))
    graph = annotate(traced, spec, autocast_device=_device_type(request.devices),
                     bf16_memory=options.precision == "bf16")
    # The user's mistakes before the (slow, first-time) measurement.
    check(graph, _checked_tp(request, tp_option(options.tp)))
    return Analyzed(spec, traced, graph,
                    _bind_calibration(_measured(request, options, graph), graph))


def _measured(request: PlanRequest, options: CompileOptions, graph: CostGraph) -> PlanRequest:
    """Times measured on this machine (pipec.calibration) unless a calibration file was given,
    the user said --measure off, or the devices are another kind (their preset stands)."""
    if options.measure == "off" or request.calibration is not None:
        return request
    local = measure_locally(options.model, request.devices, options.gpus // options.nodes,
                            options.batch_size, options.precision, options.norm,
                            options.frontend, graph)
    if local is None:
        return request
    return replace(request, calibration=local.calibration, devices=local.devices)


def _device_type(devices: tuple[Device, ...]) -> str:
    """The device type the plan trains on, which the trace fakes and whose autocast rules set
    the boundary dtypes under bf16 (`Device.device_type`: CPU for the `cpu` preset, CUDA for
    the GPU presets)."""
    return "cpu" if all(d.device_type == "cpu" for d in devices) else "cuda"


def _bind_calibration(request: PlanRequest, graph: CostGraph) -> PlanRequest:
    """Keep the calibration's per-node times only if they were measured on this graph."""
    calibration = request.calibration
    if calibration is None or not calibration.nodes:
        return request
    bound = calibration.bind(graph)
    if not bound.nodes:
        log.warning("the calibration's node times were measured on another model (or another "
                    "front end's graph); using its fitted constants instead")
    return replace(request, calibration=bound)


def compile_model(options: CompileOptions) -> tuple[Plan, Emitted]:
    analyzed = analyze(options)
    spec, traced, graph = analyzed.spec, analyzed.traced, analyzed.graph
    chosen, sharded = _plan_tp(analyzed, options.tp, options.sequence_parallel)
    norms = plan_norms(traced, graph, plan=chosen, choice=options.norm, groups=options.norm_groups)
    rewritten = with_functional_group_norms(traced.graph_module, norms.rewrites)
    staged = split(replace(traced, graph_module=rewritten), graph, chosen,
                   user_module=spec.module.__name__, regions=sharded.regions_at(chosen.tp),
                   embeddings=sharded.vocabulary_at(chosen.tp))
    emitted = emit(spec, traced, chosen, norms, staged, out=options.out, force=options.force,
                   finish=export_stages if options.onnx else None)
    log.info("wrote %s: %d stage(s), micro-batch %d, %s", emitted.out, chosen.pp,
             chosen.micro_batch, chosen.schedule)
    return chosen, emitted


def _plan_tp(analyzed: Analyzed, tp: str, sequence_parallel: str = "auto"
             ) -> tuple[Plan, Shardable]:
    """The plan, and what its tp ranks shard (nothing at tp 1): at ``tp`` ranks, or the
    fastest degree (``auto``) the node's devices and the regions allow; split along the
    sequence between the regions unless ``sequence_parallel`` is off."""
    degree, nothing = tp_option(tp), Shardable((), (), ())
    if degree == 1:
        return plan(analyzed.graph, analyzed.request), nothing
    graph, request = analyzed.graph, _per_rank_request(analyzed.request)
    shardable = find_shardable(analyzed.traced.graph_module,
                               {v.name: v.shape_high for v in graph.values})
    def options(degree: int) -> tuple[SequenceSplit, ...]:
        return _sequence_options(analyzed, shardable, degree, sequence_parallel)

    if degree is None:
        found = plan_with_tp(graph, shardable, request, tp_degrees(shardable, request),
                             options)
        if found.tp == 1:
            # Chosen on the same footing as the other degrees; planned again with the
            # model's measured node times, which only a whole-model plan may use.
            return replace(plan(graph, analyzed.request), tp_tried=found.tried), nothing
        degree, chosen = found.tp, replace(found.plan, tp_tried=found.tried)
    else:
        _check_regions(shardable, degree)
        chosen = fastest_at(graph, shardable, request, degree, options(degree))
    log.info("tensor parallelism: %d rank(s) per stage replica, %d region(s) and %d "
             "embedding(s) sharded%s", degree, len(shardable.regions_at(degree)),
             len(shardable.vocabulary_at(degree)),
             ", sequence parallel between them" if chosen.sequence_parallel else "")
    return chosen, shardable


def _sequence_options(analyzed: Analyzed, shardable: Shardable, degree: int, choice: str
                      ) -> tuple[SequenceSplit, ...]:
    """``--sequence-parallel``'s options at ``degree``: the nodes a tp rank runs on its part of
    the sequence, and none (``auto``: the faster plan wins; ``on``: only split; ``off``: only
    whole). Where the model's sequence does not split, none, and the log says why (``on``: a
    ConfigError)."""
    if choice == "off":
        return (False,)
    try:
        split = sequence_split(analyzed.traced.graph_module,
                               {v.name: v.shape_high for v in analyzed.graph.values},
                               shardable.regions_at(degree), shardable.vocabulary_at(degree),
                               degree)
    except SequenceParallelError as exc:
        if choice == "on":
            raise ConfigError(f"--sequence-parallel on at tp {degree}: {exc}; use "
                              "--sequence-parallel auto or off") from None
        log.info("no sequence parallelism at tp %d: %s", degree, exc)
        return (False,)
    if not split:
        if choice == "on":
            raise ConfigError(f"--sequence-parallel on at tp {degree}: no node between the "
                              "regions works token by token on a (batch, sequence, features) "
                              "value; use --sequence-parallel auto or off")
        return (False,)
    return (split,) if choice == "on" else (split, False)


def tp_option(tp: str) -> int | None:
    """``--tp``: a positive integer, or None for ``auto``."""
    if tp == "auto":
        return None
    if not (tp.isascii() and tp.isdecimal()) or int(tp) < 1:
        raise ConfigError(f"--tp {tp!r}: use a positive integer (the tensor-parallel ranks of "
                          "each stage replica) or auto")
    return int(tp)


def _checked_tp(request: PlanRequest, tp: int | None) -> PlanRequest:
    """The request the pipeline and replicas of ``tp`` ranks each see (``request`` itself
    without tp or under auto), once ``tp`` divides a node's devices."""
    if tp is None or tp == 1:
        return request
    per_node = request.gpus // request.nodes
    if per_node % tp:
        raise ConfigError(f"--tp {tp} does not divide the {per_node} device(s) of a node: a tp "
                          "group's collectives run within a node; use a divisor of "
                          f"{per_node} (--gpus {request.gpus}, --nodes {request.nodes})")
    return tp_groups(request, tp)


def _check_regions(shardable: Shardable, tp: int) -> None:
    if not shardable.regions_at(tp):
        why = "no Linear → Linear region or attention" if not shardable.regions else (
            f"no region divides by {tp} (its heads or features)")
        raise ConfigError(f"--tp {tp}: the model has {why}; `pipec inspect MODEL --tp {tp}` "
                          "shows which linears shard and why the others stay whole; use --tp 1")


def _per_rank_request(request: PlanRequest) -> PlanRequest:
    """A measured calibration's per-node times are the whole model's: a tp rank runs a share
    of some nodes, so its plan takes the fitted constants (on its FLOPs) instead."""
    calibration = request.calibration
    if calibration is None or not calibration.nodes:
        return request
    return replace(request, calibration=calibration.fitted())


def _request(options: CompileOptions) -> PlanRequest:
    """The plan request the options make, checked before anything reads the model."""
    if tp_option(options.tp) != 1 and options.onnx:
        raise ConfigError(f"--onnx with --tp {options.tp}: the ONNX stages are whole-model "
                          "stages, and a tp rank's are its parts; drop one of the two")
    if options.onnx:
        require_onnx()
    if options.measure not in MEASURE_CHOICES:
        raise ConfigError(f"--measure {options.measure!r} (or PIPEC_MEASURE): use auto or off")
    request = PlanRequest(
        **{name: getattr(options, name) for name in _SHARED_WITH_REQUEST},
        global_batch=options.batch_size, devices=load_devices(options.hardware, options.gpus),
        training=Training(options.optimizer, options.precision),
        calibration=load_calibration(options.calibration) if options.calibration else None)
    check_request(request)
    if options.calibration is not None and len(set(request.devices)) > 1:
        raise ConfigError("--calibration measures one kind of device, but --hardware "
                          f"{options.hardware!r} lists several; drop one of the two")
    return request


# The options the plan request takes as they are; it derives the others (the calibration: a
# file's path in the options, its contents in the request; tp: "auto" or a number in the
# options, the request's per tp group, pipec.planning.tp_search.tp_groups).
_SHARED_WITH_REQUEST = tuple(
    f.name for f in fields(PlanRequest)
    if f.name in {o.name for o in fields(CompileOptions)}
    - {"calibration", "tp", "sequence_parallel"})
