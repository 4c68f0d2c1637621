"""compile_model(): the pass list, one line per pass."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from pipec.annotate import CostGraph, annotate
from pipec.calibrationfile import load_calibration
from pipec.costmodel import Training
from pipec.emit import Emitted, emit
from pipec.errors import ConfigError
from pipec.hardware import DEFAULT, Device, load_devices
from pipec.loader import ModelSpec, load_model_file
from pipec.measured import MEASURE_CHOICES, measure_locally
from pipec.normalize import plan_norms, with_functional_group_norms
from pipec.onnx_export import export_stages, require_onnx
from pipec.planner import Plan, PlanRequest, check, plan
from pipec.split import split
from pipec.trace import Traced, trace_model

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompileOptions:
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
    """Times measured on this machine (pipec.measured) unless a calibration file was given, the
    user said --measure off, or the devices are another kind (their preset stands)."""
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
    """Check the options that need no model, so that mistakes are reported before tracing."""
    if options.onnx:
        require_onnx()
    if options.gpus < 1:
        raise ConfigError(f"--gpus {options.gpus}: need at least 1 device")
    if options.nodes < 1 or options.gpus % options.nodes:
        raise ConfigError(f"--gpus {options.gpus} is not divisible by --nodes {options.nodes}; "
                          "every node runs the same number of devices")
    if options.batch_size < 1:
        raise ConfigError(f"--batch-size {options.batch_size}: must be a positive integer")
    if options.pp is not None and options.pp < 1:
        raise ConfigError(f"--pp {options.pp}: need at least 1 stage")
    if options.optimizer not in ("sgd", "adamw"):
        raise ConfigError(f"--optimizer {options.optimizer!r}: use sgd or adamw")
    if options.virtual_stages is not None and options.virtual_stages < 2:
        raise ConfigError(f"--virtual-stages {options.virtual_stages}: interleaving needs 2 or "
                          "more stages per device")
    if options.margin is not None and not 0 <= options.margin < 1:
        raise ConfigError(f"--margin {options.margin:.0%}: give a percentage from 0 to 99 (0: "
                          "the fastest predicted plan, however close the runner-up)")
    if options.measure not in MEASURE_CHOICES:
        raise ConfigError(f"--measure {options.measure!r} (or PIPEC_MEASURE): use auto or off")
    if options.precision not in ("fp32", "bf16"):
        raise ConfigError(f"--precision {options.precision!r}: use fp32 or bf16")
    return PlanRequest(
        gpus=options.gpus, nodes=options.nodes, global_batch=options.batch_size, pp=options.pp,
        micro_batch=options.micro_batch, schedule=options.schedule, hardware=options.hardware,
        devices=_devices(options),
        training=Training(options.optimizer, options.precision),
        calibration=load_calibration(options.calibration) if options.calibration else None,
        strategy=options.strategy, virtual_stages=options.virtual_stages, margin=options.margin,
        norm=options.norm, recompute=options.recompute, mesh=options.mesh, fsdp=options.fsdp,
        boundaries=options.boundaries)


def _devices(options: CompileOptions) -> tuple[Device, ...]:
    devices = load_devices(options.hardware, options.gpus)
    if options.calibration is not None and len(set(devices)) > 1:
        raise ConfigError("--calibration measures one kind of device, but --hardware "
                          f"{options.hardware!r} lists several; drop one of the two")
    return devices
