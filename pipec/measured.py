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
import math
import os
import platform
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from pipec.actions import SCHEDULE_MICRO_BATCHES
from pipec.allreduces import DATA_PARALLEL_SHAPES, data_parallel_bytes, data_parallel_tensors
from pipec.calibrate import PROFILE_SIZES, profile_model
from pipec.calibrationfile import load_calibration, save_calibration
from pipec.costmodel import Calibration, data_parallel_collectives
from pipec.errors import ConfigError, PipecError
from pipec.hardware import Device
from pipec.probe import RuntimeFigures, probe_runtime
from pipec.schedule import ZERO_BUBBLE, posted_links, simulate, stage_device

log = logging.getLogger(__name__)

MEASURE_CHOICES = ("auto", "off")
# The compute times' cache: bump when what is measured for them, or how, changes.
CACHE_VERSION = 16  # 16: the split backward at the largest profiled size
# The runtime probe's (pipec.probe), bumped apart so that the compute times stay cached: 16
# measures the smaller data-parallel groups too.
RUNTIME_CACHE_VERSION = 16
REPEATS = 10  # passes per micro-batch size, as pipec profile's default, at least
# This machine's speed drifts by ±15 % from one 2-second window to the next (a shared virtual
# machine): passes spread over this many seconds average it out.
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


@dataclass(frozen=True)
class Local:
    """What this machine measured: the model's compute times, and the devices with the
    training runtime's figures (links, all-reduce, per action and per step) where measured."""

    calibration: Calibration
    devices: tuple[Device, ...]


def measure_locally(model: Path, devices: tuple[Device, ...], processes_per_node: int,
                    batch_size: int, precision: str, norm: str) -> Local | None:
    """``model`` measured here, from the cache or now; None when the devices are not this
    machine's kind (the preset's roofline is used, as before)."""
    device_type = _local_device_type(devices)
    if device_type is None:
        return None
    threads = training_threads(processes_per_node)
    target = Target(device_type, _device_name(device_type), threads,
                    _max_micro_batch(batch_size), precision,
                    "keep" if norm in ("keep", "sync") else "group",
                    processes_per_node if device_type == "cpu" else 1)
    calibration = _compute_times(model, target)
    if calibration is None:
        return None
    runtime = _runtime(target, processes_per_node)
    if runtime is None:
        return Local(calibration, devices)
    source = (f"{calibration.source}; links, all-reduce and the training runtime's own time "
              f"measured with {runtime.processes} processes")
    return Local(replace(calibration, source=source),
                 tuple(_with_runtime(d, runtime) for d in devices))


def _compute_times(model: Path, target: Target) -> Calibration | None:
    path = cache_dir() / f"{model.stem}-{cache_key(model, target)[:20]}.json"
    cached = _read(path)
    if cached is not None:
        log.debug("compute times of %s on this machine: read from the cache %s", model, path)
        return replace(cached, source=_source(target, path, cached.contention))
    try:
        measured = _measure(model, target)
    except PipecError as exc:
        log.warning("could not measure %s here (%s); planning from the preset", model, exc)
        return None
    except Exception as exc:  # measuring is an option: any failure falls back to the preset
        log.warning("could not measure %s here (%s: %s); planning from the preset (or pass "
                    "--measure off)", model, type(exc).__name__, exc)
        return None
    _write(measured, path)
    return replace(measured, source=_source(target, path, measured.contention))


def _runtime(target: Target, processes: int) -> RuntimeFigures | None:
    """The training runtime's figures on this machine's CPU for ``processes`` processes (not
    measured for one process, nor on GPUs yet), from the cache or measured now."""
    if target.device_type != "cpu" or processes < 2:
        return None
    fields = {"device": target.device_name, "threads": target.threads, "processes": processes,
              "torch": torch.__version__, "version": RUNTIME_CACHE_VERSION}
    key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
    path = cache_dir() / f"runtime-{key[:20]}.json"
    with contextlib.suppress(OSError, ValueError, TypeError):
        return RuntimeFigures(**json.loads(path.read_text()))
    log.info("measuring the training runtime on this machine with %d processes, once", processes)
    try:
        figures = probe_runtime(processes, target.threads)
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


def data_parallel_fit(runtime: RuntimeFigures, replicas: int | None = None
                      ) -> tuple[float, float, float]:
    """Each all-reduce's wait in a step, the bus bandwidth and the time per gradient tensor
    that make the model reproduce the probe's three data-parallel steps (DATA_PARALLEL_SHAPES)
    on every process, or on ``replicas`` of them while the others wait
    (``group_data_parallel_s``): the all-reduces of data_parallel_collectives, the ring's
    latency and bytes, DDP's work per gradient tensor, the runtime's step overhead, and the lead
    one process takes on the other over the step's compute (blocking_fit's drift · √T). The
    third model, with as few bytes as the first but 12 times its tensors, gives the time per
    tensor; the first, whose bytes cost next to nothing, the wait; the second, the bandwidth
    (the all-reduce's own where its bytes explain less than the noise)."""
    d = replicas or runtime.processes
    steps = (runtime.data_parallel_s if replicas is None
             else dict((int(n), s) for n, s in runtime.group_data_parallel_s)[replicas])
    share = 2 * (d - 1) / d  # of the bytes, over the bus
    fixed = runtime.step_overhead_s + 2 * (d - 1) * runtime.latency_s  # the ring's
    drift = blocking_fit(runtime)[1]
    small_s, large_s, many_s = (extra - drift * math.sqrt(compute) for compute, extra in steps)
    small, large, many = (data_parallel_bytes(*shape) for shape in DATA_PARALLEL_SHAPES)
    small_t, large_t, many_t = (data_parallel_tensors(n) for _, n in DATA_PARALLEL_SHAPES)
    bandwidth, per_tensor, collective = runtime.allreduce_bandwidth, 0.0, 0.0
    for _ in range(3):  # the small models' few bytes, at the bandwidth fitted so far
        per_tensor = max(many_s - small_s - share * (many - small) / bandwidth, 0.0) \
            / (many_t - small_t)
        collective = max(small_s - fixed - share * small / bandwidth - small_t * per_tensor,
                         0.0) / data_parallel_collectives(small)
        bytes_s = large_s - fixed - data_parallel_collectives(large) * collective \
            - large_t * per_tensor
        bandwidth = share * large / bytes_s if bytes_s > 0 else runtime.allreduce_bandwidth
    return collective, bandwidth, per_tensor


def blocking_fit(runtime: RuntimeFigures) -> tuple[float, float]:
    """A blocking all-reduce's cost in a pass as a + drift · √T, T the compute since the one
    before, through the blocking probe's two sizes: between two waits each replica's compute
    wanders by independent amounts (its kernels' times, what else the cores run), which add up
    as a random walk's, ∝ √T; the replica that waits waits for the other's lead. (0, 0) where
    not measured."""
    if len(runtime.blocking_s) < 2:
        return 0.0, 0.0
    (short_s, short_extra), (long_s, long_extra) = runtime.blocking_s[:2]
    rise = math.sqrt(long_s) - math.sqrt(short_s)
    drift = max((long_extra - short_extra) / rise, 0.0) if rise > 0 else 0.0
    return max(short_extra - drift * math.sqrt(short_s), 0.0), drift


def runtime_action_fit(runtime: RuntimeFigures) -> tuple[float, float]:
    """(seconds per action, seconds per send or receive posted to another device) with which
    the simulator best reproduces the probe's measured steps of every schedule (pipec.probe's
    2-device pipelines of a layer without compute); (0, 0) where not measured.

    Least squares in the relative error, both ≥ 0, by Gauss-Newton: a step is piecewise
    linear in both. Two terms, not a time per action for each schedule: ZB-V posts a send or
    receive in 2 of its 3 actions per stage and micro-batch, interleaved 1F1B in every one,
    and a per-schedule time per action learnt that from the probe's pipeline, where
    every action waits for the other device, then charged it to every action of a real plan.
    Re-predicting 248 measured plans of seven fidelity runs (benchmarks/repredict.py), the
    error between plans of one model fell from 6.1 to 5.3 % (median), 10.9 to 9.8 % (75th
    percentile), with the posts × the contention of every process (planning.costs)."""
    if not runtime.schedule_step_s:
        return 0.0, 0.0
    link = runtime.latency_s + 16 / runtime.bandwidth  # a micro-batch of 4 fp32 values
    return _action_fit(tuple(sorted(runtime.schedule_step_s.items())), link)


@functools.cache  # each device of a compile asks (tens of ms each)
def _action_fit(measured: tuple[tuple[str, float], ...], link: float) -> tuple[float, float]:
    steps = dict(measured)
    names = sorted(steps)
    fit = np.array([min(steps.values()) / (4 * SCHEDULE_MICRO_BATCHES), 0.0])
    for _ in range(_FIT_ROUNDS):
        errors = np.array([_relative_error(s, fit, steps[s], link) for s in names])
        slopes = np.array([[(_relative_error(s, fit + step, steps[s], link) - error)
                            / _SLOPE_STEP_S for step in _SLOPE_STEPS]
                           for s, error in zip(names, errors, strict=True)])
        fit = _nonnegative_lstsq(slopes, slopes @ fit - errors)
    return float(fit[0]), float(fit[1])


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ‖a·x − b‖ over x ≥ 0, for ``a`` of two columns: the unconstrained answer where
    it is non-negative, else the better of the answers with one of the two at 0."""
    candidates = [np.linalg.lstsq(a, b, rcond=None)[0]]
    for column in range(2):
        alone = np.zeros(2)
        norm = float(a[:, column] @ a[:, column])
        alone[column] = max(float(a[:, column] @ b) / norm, 0.0) if norm > 0 else 0.0
        candidates.append(alone)
    feasible = [x for x in candidates if (x >= 0).all()]
    return min(feasible, key=lambda x: float(np.linalg.norm(a @ x - b)))


_FIT_ROUNDS = 12  # Gauss-Newton's; it settles in 3-5 on this machine's probes
_SLOPE_STEP_S = 1e-6
_SLOPE_STEPS = (np.array([_SLOPE_STEP_S, 0.0]), np.array([0.0, _SLOPE_STEP_S]))


def _relative_error(schedule: str, fit: np.ndarray, step_s: float, link_s: float) -> float:
    return probe_step_s(schedule, float(fit[0]), float(fit[1]), link_s) / step_s - 1


def probe_step_s(schedule: str, action_s: float, post_s: float, link_s: float) -> float:
    """The simulated step of the probe's pipeline under ``schedule`` (pipec.actions): each
    action pays ``action_s``, and ``post_s`` per send or receive to the other device, each
    boundary that crosses a link ``link_s``, as Costs charges them; a zero-bubble backward pays
    its call's time twice, its weights' gradient once, and the links carry the transfers
    (planning.evaluate)."""
    stages = 2 if schedule in ("gpipe", "1f1b") else 4
    cuts = probe_cuts(schedule, stages, link_s)
    links = (cuts, [0.0, *cuts[:-1]])  # forward to the next stage, backward to the one before
    posts = posted_links([stage_device(schedule, k, 2) for k in range(stages)])
    forward = [action_s + post_s * n for n in posts]
    if schedule not in ZERO_BUBBLE:
        return simulate(schedule, forward, forward, SCHEDULE_MICRO_BATCHES, 2,
                        timeline=False, transfer_s=links).iteration_s
    return simulate(schedule, forward, [f + action_s for f in forward],
                    SCHEDULE_MICRO_BATCHES, 2, timeline=False,
                    weight_s=[action_s] * stages, transfer_s=links).iteration_s


def probe_cuts(schedule: str, stages: int, link_s: float) -> list[float]:
    """Per stage of the probe's pipeline, the link its output crosses: none after the last,
    nor where the next stage sits on the same device (ZB-V's turn), as Costs charges them."""
    return [link_s if k < stages - 1 and stage_device(schedule, k, 2)
            != stage_device(schedule, k + 1, 2) else 0.0 for k in range(stages)]


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
              **target.__dict__}
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
    return max([s for s in PROFILE_SIZES if s <= batch_size] or [batch_size])


def _measure(model: Path, target: Target) -> Calibration:
    log.info("measuring %s on this machine (%s, %d thread%s) at micro-batch sizes up to %d, "
             "once: later compiles read the cache", model, target.device_name, target.threads,
             "" if target.threads == 1 else "s", target.max_micro_batch)
    started = time.perf_counter()
    with _threads(target.threads):
        calibration, _ = profile_model(model, target.max_micro_batch, target.device_type,
                                       REPEATS, target.norm, target.precision, MIN_SECONDS,
                                       target.processes)
    log.info("measured %d nodes in %.1f s", len(calibration.nodes), time.perf_counter() - started)
    return calibration


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


def _source(target: Target, path: Path, contention: float) -> str:
    """The same whether this compile measured or read the cache: compiling twice gives
    identical files."""
    threads = f"{target.threads} thread{'' if target.threads == 1 else 's'}"
    side = (f", × {contention:.2f} with {target.processes} processes computing side by side,"
            " faster where fewer compute" if target.processes > 1 else "")
    return f"measured on this machine ({target.device_name}, {threads}{side}; cached in {path})"
