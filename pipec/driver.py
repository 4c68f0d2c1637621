"""compile_model(): the pass list, one line per pass."""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields, replace
from pathlib import Path

from pipec.calibration import MEASURE_CHOICES, measure_locally
from pipec.codegen import Emitted, emit, export_stages, require_onnx, split
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
from pipec.planning import Plan, PlanRequest, check, check_request, plan

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
    fsdp: str = "auto"  # "auto", "off", "zero2" or "zero3"
    optimizer: str = "sgd"
    precision: str = "fp32"
    calibration: Path | None = None
    measure: str = "auto"  # "auto": time the model here when the devices are this machine's
    strategy: str = "pipec"
    virtual_stages: int | None = None
    boundaries: tuple[int, ...] | None = None  # pinned: each later stage's first node
    margin: float | None = None  # a fraction; None: the time model's measured error
    frontend: str = "auto"
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
    check(graph, request)  # the user's mistakes before the (slow, first-time) measurement
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
    chosen = plan(graph, analyzed.request)
    norms = plan_norms(traced, graph, plan=chosen, choice=options.norm, groups=options.norm_groups)
    rewritten = with_functional_group_norms(traced.graph_module, norms.rewrites)
    staged = split(replace(traced, graph_module=rewritten), graph, chosen,
                   user_module=spec.module.__name__)
    emitted = emit(spec, traced, chosen, norms, staged, out=options.out, force=options.force,
                   finish=export_stages if options.onnx else None)
    log.info("wrote %s: %d stage(s), micro-batch %d, %s", emitted.out, chosen.pp,
             chosen.micro_batch, chosen.schedule)
    return chosen, emitted


def _request(options: CompileOptions) -> PlanRequest:
    """The plan request the options make, checked before anything reads the model."""
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
# file's path in the options, its contents in the request).
_SHARED_WITH_REQUEST = tuple(
    f.name for f in fields(PlanRequest)
    if f.name in {o.name for o in fields(CompileOptions)} - {"calibration"})
