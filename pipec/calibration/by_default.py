"""Measured by default: when the plan's devices are this machine's kind (the `cpu` preset here,
the local GPU's preset on a GPU machine), `pipec compile` times the model here, as
`pipec profile` does, instead of trusting a roofline, and caches what it measured.

The cache key is everything the times depend on: the model file's bytes, the micro-batch sizes
timed, the precision and normalization timed, torch's version, the device and the number of
threads each training process computes with. A second compile with the same key reads the
cache and measures nothing. The cache lives in ``$PIPEC_CACHE_DIR``, else
``$XDG_CACHE_HOME/pipec``, else ``~/.cache/pipec``; deleting it is always safe.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from pipec.calibration.blocks import fitting_sizes, measuring_plan, profile_by_blocks
from pipec.calibration.gpu_probe import probe_gpu_runtime
from pipec.calibration.heap import heap_settings, set_training_heap
from pipec.calibration.probe import RuntimeFigures, probe_runtime
from pipec.calibration.profile import profile_model, profile_sizes
from pipec.calibration.runtime_fit import blocking_fit, data_parallel_fit, runtime_action_fit
from pipec.cost.calibration_file import load_calibration, save_calibration
from pipec.cost.hardware import Device
from pipec.cost.model import Calibration
from pipec.errors import ConfigError, PipecError
from pipec.frontend.annotate import CostGraph, annotate
from pipec.frontend.loader import load_model_file
from pipec.frontend.trace import trace_model
from pipec.units import gib

log = logging.getLogger(__name__)

MEASURE_CHOICES = ("auto", "off")
BY_BLOCKS = "block by block"
# The compute times' cache: bump when what is measured for them, or how, changes.
CACHE_VERSION = 17
# The runtime probe's (pipec.calibration.probe), bumped apart so that the compute times can stay
# cached.
RUNTIME_CACHE_VERSION = 18
REPEATS = 10  # passes per micro-batch size, as pipec profile's default, at least
# Passes spread over this many seconds average out a shared machine's drift (±15 % from one
# 2-second window to the next, measured on a 2-core AMD EPYC VM).
MIN_SECONDS = 12.0

# A GPU preset is this machine's GPU when CUDA's device name holds the token and the memory
# agrees within 15 % (the data sheet's GiB against what CUDA reports).
_GPU_TOKENS = {"v100-16g": "V100", "v100-32g": "V100", "a100-40g": "A100", "a100-80g": "A100",
               "h100-80g": "H100", "h200": "H200", "l4": "L4", "rtx4090": "4090"}


@dataclass(frozen=True)
class Target:
    """What a measurement on this machine stands for: its key fields."""

    device_type: str  # "cpu" or "cuda"
    device_name: str
    threads: int
    max_micro_batch: int
    precision: str
    norm: str
    processes: int = 1  # computing side by side on this machine (CPU processes of one node)
    frontend: str = "auto"  # the graph whose nodes are timed (pipec.frontend.trace)


@dataclass(frozen=True)
class Local:
    """What this machine measured: the model's compute times, and the devices with the
    training runtime's figures (links, all-reduce, per action and per step) where measured."""

    calibration: Calibration
    devices: tuple[Device, ...]


def measure_locally(model: Path, devices: tuple[Device, ...], processes_per_node: int,
                    batch_size: int, precision: str, norm: str, frontend: str = "auto",
                    graph: CostGraph | None = None) -> Local | None:
    """``model`` measured here, from the cache or now; None when the devices are not this
    machine's kind, or when measuring would not fit this machine's free memory (``graph``
    says how much it needs): the preset's roofline is used, and a warning says why."""
    device_type = _local_device_type(devices)
    if device_type is None:
        return None
    threads = training_threads(processes_per_node)
    target = Target(device_type, _device_name(device_type), threads,
                    _max_micro_batch(batch_size), precision,
                    "keep" if norm in ("keep", "sync") else "group",
                    processes_per_node if device_type == "cpu" else 1, frontend)
    calibration = _compute_times(model, target, graph)
    if calibration is None:
        return None
    runtime = _runtime(target, processes_per_node)
    if runtime is None:
        return Local(calibration, devices)
    source = (f"{calibration.source}; links, all-reduce and the training runtime's own time "
              f"measured with {runtime.processes} processes")
    return Local(replace(calibration, source=source),
                 tuple(_with_runtime(d, runtime) for d in devices))


def _compute_times(model: Path, target: Target, graph: CostGraph | None = None
                   ) -> Calibration | None:
    path = cache_dir() / f"{model.stem}-{cache_key(model, target)[:20]}.json"
    cached = _read(path)
    if cached is not None:
        log.debug("compute times of %s on this machine: read from the cache %s", model, path)
        return replace(cached, source=_source(target, path, cached.contention,
                                               BY_BLOCKS in cached.source))
    measure: Callable[[], Calibration] = functools.partial(_measure, model, target)
    if graph is not None and not _fits_here(graph, target):
        by_blocks = _block_measure(model, graph, target)
        if by_blocks is None:
            return None
        measure = by_blocks
    try:
        measured = measure()
    except PipecError as exc:
        log.warning("could not measure %s here (%s); planning from the preset", model, exc)
        return None
    except Exception as exc:  # measuring is an option: any failure falls back to the preset
        log.warning("could not measure %s here (%s: %s); planning from the preset (or pass "
                    "--measure off)", model, type(exc).__name__, exc)
        return None
    _write(measured, path)
    return replace(measured, source=_source(target, path, measured.contention,
                                            BY_BLOCKS in measured.source))


def _runtime(target: Target, processes: int) -> RuntimeFigures | None:
    """The training runtime's figures on this machine for ``processes`` processes, one GPU each
    on a GPU machine (as many as it has, if fewer; not measured for one), from the cache or
    measured now."""
    if target.device_type == "cuda":
        processes = min(processes, torch.cuda.device_count())
    if processes < 2:
        return None
    fields = {"device": target.device_name, "threads": target.threads, "processes": processes,
              "torch": torch.__version__, "version": RUNTIME_CACHE_VERSION, **heap_settings()}
    key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
    path = cache_dir() / f"runtime-{key[:20]}.json"
    with contextlib.suppress(OSError, ValueError, TypeError):
        return RuntimeFigures(**json.loads(path.read_text()))
    log.info("measuring the training runtime on this machine with %d processes, once", processes)
    try:
        figures = (probe_gpu_runtime(processes) if target.device_type == "cuda"
                   else probe_runtime(processes, target.threads))
    except (RuntimeError, OSError) as exc:
        log.warning("could not measure the training runtime here (%s); using the preset's "
                    "links", exc)
        return None
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(asdict(figures), indent=2) + "\n")
        temporary.replace(path)
    return figures


def _with_runtime(device: Device, runtime: RuntimeFigures) -> Device:
    if runtime.device_type == "cuda":
        return _with_gpu_runtime(device, runtime)
    collective, bandwidth, per_tensor = data_parallel_fit(runtime)
    blocking, drift = blocking_fit(runtime)
    action, post = runtime_action_fit(runtime)
    return replace(device, intra_node_latency_s=runtime.latency_s,
                   intra_node_bandwidth=runtime.bandwidth, allreduce_bandwidth=bandwidth,
                   step_collective_s=collective, gradient_tensor_s=per_tensor,
                   blocking_collective_s=blocking,
                   blocking_drift=drift, action_overhead_s=runtime.action_overhead_s,
                   step_overhead_s=runtime.step_overhead_s,
                   relay_slowdowns=tuple(runtime.relay_slowdowns),
                   late_receive_s=runtime.late_receive_s,
                   schedule_action_s=tuple((schedule, action)
                                           for schedule in sorted(runtime.schedule_step_s)),
                   p2p_post_s=post,
                   replica_collectives=tuple((int(d), *data_parallel_fit(runtime, int(d)))
                                             for d, _ in runtime.group_data_parallel_s),
                   split_backward_node_s=runtime.split_backward_node_s,
                   # On a GPU the policy's host time runs ahead of the kernels (hidden).
                   selective_node_s=runtime.selective_node_s
                   if device.device_type == "cpu" else 0.0)


def _with_gpu_runtime(device: Device, runtime: RuntimeFigures) -> Device:
    """The GPU probe's figures in place of the preset's (pipec.calibration.gpu_probe): links,
    all-reduce and the runtime's time per action, post and step. DDP's and a blocking
    all-reduce's terms stay the preset's."""
    action, post = runtime_action_fit(runtime)
    return replace(device, intra_node_latency_s=runtime.latency_s,
                   intra_node_bandwidth=runtime.bandwidth,
                   allreduce_bandwidth=runtime.allreduce_bandwidth,
                   action_overhead_s=runtime.action_overhead_s,
                   step_overhead_s=runtime.step_overhead_s,
                   schedule_action_s=tuple((schedule, action)
                                           for schedule in sorted(runtime.schedule_step_s)),
                   p2p_post_s=post)


def training_threads(processes_per_node: int) -> int:
    """The threads each training process computes with: OMP_NUM_THREADS when set, else torchrun's
    default (1 per process when it starts several), else torch's own default."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) > 0:
        return int(value)
    return 1 if processes_per_node > 1 else torch.get_num_threads()


def cache_dir() -> Path:
    if "PIPEC_CACHE_DIR" in os.environ:
        return Path(os.environ["PIPEC_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pipec"


def cache_key(model: Path, target: Target) -> str:
    try:
        content = hashlib.sha256(model.read_bytes()).hexdigest()
    except OSError as exc:
        raise ConfigError(f"model file {model}: {exc}") from None
    fields = {"model": content, "torch": torch.__version__, "version": CACHE_VERSION,
              **heap_settings(), **target.__dict__}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def _local_device_type(devices: tuple[Device, ...]) -> str | None:
    if all(d.device_type == "cpu" for d in devices):
        return "cpu"
    if torch.cuda.is_available() and all(_is_local_gpu(d) for d in devices):
        return "cuda"
    return None


def _is_local_gpu(device: Device) -> bool:
    token = _GPU_TOKENS.get(device.name)
    properties = torch.cuda.get_device_properties(0)
    return (device.device_type == "cuda" and token is not None and token in properties.name
            and abs(properties.total_memory / device.memory_bytes - 1) <= 0.15)


def _device_name(device_type: str) -> str:
    if device_type == "cuda":
        return str(torch.cuda.get_device_name(0))
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} × {os.cpu_count()}"
    return f"{platform.processor() or platform.machine()} × {os.cpu_count()}"


def _max_micro_batch(batch_size: int) -> int:
    """The largest size pipec profile times for this batch (1, 2, 4, … up to it)."""
    return profile_sizes(batch_size)[-1]


def _measure(model: Path, target: Target) -> Calibration:
    log.info("measuring %s on this machine (%s, %d thread%s) at micro-batch sizes up to %d, "
             "once: later compiles read the cache", model, target.device_name, target.threads,
             "" if target.threads == 1 else "s", target.max_micro_batch)
    started = time.perf_counter()
    with _threads(target.threads):
        calibration, _ = profile_model(model, target.max_micro_batch, target.device_type,
                                       REPEATS, target.norm, target.precision, MIN_SECONDS,
                                       target.processes, target.frontend)
    log.info("measured %d nodes in %.1f s", len(calibration.nodes), time.perf_counter() - started)
    return calibration


def profile_bytes(graph: CostGraph, micro_batch: int) -> float:
    """What measuring holds at its peak: the whole model's weights, gradients and buffers, and
    every node's saved activations at ``micro_batch`` (its passes run the model whole)."""
    weights = sum(n.param_bytes for n in graph.nodes)
    return (2 * weights + sum(n.buffer_bytes for n in graph.nodes)
            + sum(n.saved_bytes.at(micro_batch) for n in graph.nodes))


def free_bytes(device_type: str) -> float:
    """Memory free for a new allocation: the GPU's, or the host's MemAvailable."""
    if device_type == "cuda":
        return float(torch.cuda.mem_get_info()[0])
    with contextlib.suppress(OSError, ValueError, StopIteration):
        line = next(line for line in Path("/proc/meminfo").read_text().splitlines()
                    if line.startswith("MemAvailable:"))
        return float(line.split()[1]) * 1024
    return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


# Measuring starts only when its peak fits in this share of the free memory: the rest is for
# the process itself, the allocator's slack and what the host runs beside it.
PROFILE_MEMORY_SHARE = 0.7


def _fits_here(graph: CostGraph, target: Target) -> bool:
    needed = profile_bytes(graph, target.max_micro_batch)
    return needed <= PROFILE_MEMORY_SHARE * free_bytes(target.device_type)


def _block_measure(model: Path, graph: CostGraph, target: Target
                   ) -> Callable[[], Calibration] | None:
    """Where the whole model would not fit: measuring it block by block (pipec.calibration.
    blocks), or None, with a warning that says why, where that does not fit either (the
    preset's roofline stands)."""
    free = free_bytes(target.device_type)
    where = "GPU" if target.device_type == "cuda" else "host"
    needed = profile_bytes(graph, target.max_micro_batch)
    why = (f"its passes would hold the whole model, {gib(needed)} with its gradients and "
           f"activations at micro-batch {target.max_micro_batch}, and this {where} has "
           f"{gib(free)} free")
    plan = measuring_plan(graph)
    sizes = profile_sizes(target.max_micro_batch)
    fitting = [] if plan is None else fitting_sizes(graph, plan, sizes, PROFILE_MEMORY_SHARE * free)
    if plan is None or not fitting:
        log.warning("not measuring %s here: %s, and %s; planning from the preset (--measure off "
                    "says so without checking)", model, why,
                    "its graph has no run of identical blocks to time one at a time"
                    if plan is None else "even its largest span at micro-batch 1 would not fit")
        return None
    log.info("measuring %s block by block: %s. Its %d identical blocks (%s.0 to %s.%d) are "
             "timed once, on the first, with what comes before and after them, at micro-batch "
             "sizes up to %d", model, why, len(plan.blocks.starts), plan.blocks.container,
             plan.blocks.container, len(plan.blocks.starts) - 1, fitting[-1])
    return functools.partial(_measure_blocks, model, target, fitting)


def _measure_blocks(model: Path, target: Target, sizes: list[int]) -> Calibration:
    device = torch.device(target.device_type)
    started = time.perf_counter()
    with _threads(target.threads):
        if device.type == "cpu":
            set_training_heap()
        spec = load_model_file(model)
        traced = trace_model(spec, target.frontend, device.type)
        graph = annotate(traced, spec, bf16_memory=False)
        plan = measuring_plan(graph)
        if plan is None:
            raise ConfigError(f"{model}: the traced graph has no run of identical blocks")
        calibration = profile_by_blocks(spec, traced, graph, plan, sizes, device, REPEATS,
                                        target.precision == "bf16", MIN_SECONDS,
                                        target.processes)
    log.info("measured %d nodes block by block in %.1f s", len(calibration.nodes),
             time.perf_counter() - started)
    return replace(calibration, source=f"pipec profile, {BY_BLOCKS}")


@contextlib.contextmanager
def _threads(count: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _read(path: Path) -> Calibration | None:
    if not path.is_file():
        return None
    try:
        return load_calibration(path)
    except ConfigError as exc:
        log.warning("ignoring the cached measurement %s (%s); measuring again", path, exc)
        return None


def _write(calibration: Calibration, path: Path) -> None:
    """Written whole or not at all: a temporary file renamed, so an interrupted compile never
    leaves a half-written entry. A cache that cannot be written costs the next compile a
    measurement, nothing else."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        save_calibration(calibration, temporary)
        temporary.replace(path)
    except OSError as exc:
        log.warning("could not cache the measurement in %s (%s)", path, exc)


def _source(target: Target, path: Path, contention: float, by_blocks: bool = False) -> str:
    """The same whether this compile measured or read the cache: compiling twice gives
    identical files."""
    threads = f"{target.threads} thread{'' if target.threads == 1 else 's'}"
    side = (f", × {contention:.2f} with {target.processes} processes computing side by side,"
            " faster where fewer compute" if target.processes > 1 else "")
    blocks = "block by block, " if by_blocks else ""
    return (f"measured on this machine ({blocks}{target.device_name}, {threads}{side}; cached "
            f"in {path})")
