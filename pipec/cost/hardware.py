"""Device presets and topology; figures are vendor data-sheet peaks (docs/hardware.md)."""

from __future__ import annotations

import functools
import json
from dataclasses import MISSING, dataclass, fields, replace
from pathlib import Path
from typing import Any

from pipec.errors import ConfigError
from pipec.units import GIB, MIB

GB = 1e9
TFLOPS = 1e12


@dataclass(frozen=True)
class Device:
    """One accelerator (or CPU process) and its links.

    ``efficiency`` is the fraction of peak FLOP/s that dense training kernels reach;
    ``kernel_overhead_s`` is the fixed launch / framework cost per graph node, which makes very
    small micro-batches inefficient (the trade-off the micro-batch search exploits).
    """

    name: str
    fp32_flops: float
    bf16_flops: float
    memory_bandwidth: float  # bytes/s
    memory_bytes: float
    intra_node_bandwidth: float  # bytes/s, one direction, between two devices of a node
    inter_node_bandwidth: float  # bytes/s, one direction, between nodes
    intra_node_latency_s: float
    inter_node_latency_s: float
    kernel_overhead_s: float
    efficiency: float
    # Held by each process before the model is built and outside what the allocator reports
    # (CUDA context, NCCL/gloo communicators, interpreter and libraries): not for the model.
    process_bytes: float = 0.0
    # Allocated by the training runtime beside the model's own terms, inside the measured peak.
    runtime_bytes: float = 0.0
    # Fraction of the rest lost to the allocator's fragmentation (reserved but not allocated).
    fragmentation: float = 0.0
    # Per operator class, the fraction of peak FLOP/s its kernels reach where it differs from
    # ``efficiency`` (None: ``efficiency``): matrix products and convolutions, and fused
    # attention. A small kernel's lower rate comes from kernel_overhead_s, paid per node.
    matmul_efficiency: float | None = None
    attention_efficiency: float | None = None
    # Held outside the allocator by each communicator a rank uses beyond the one process_bytes
    # counts (NCCL: one per process group and one per pair of ranks that send to each other):
    # a two-rank communicator, and one of more ranks.
    communicator_bytes: float = 0.0
    group_communicator_bytes: float = 0.0
    # "cuda" or "cpu": the backend the emitted script runs on it (its autocast rules; whether
    # data made on the host sits in the device's memory).
    device_type: str = "cuda"
    # The training runtime's own time, beyond kernels and links: per forward or backward
    # action of a stage (torch.distributed.pipelining's bookkeeping), and per step (the loss's
    # all-reduce; the optimizer step and the step's data are terms of their own). 0: not
    # measured for this device.
    action_overhead_s: float = 0.0
    step_overhead_s: float = 0.0
    # Per schedule, the runtime's own time per action (its bookkeeping between actions), in
    # place of action_overhead_s; measured here, one fit for every schedule
    # (pipec.calibration.runtime_fit.runtime_action_fit).
    schedule_action_s: tuple[tuple[str, float], ...] = ()
    # What an action pays per send or receive it posts to a stage on another device, beyond
    # the link's latency and bytes: torch's batch_isend_irecv on gloo and its wait (measured
    # with the time per action; 0: not measured).
    p2p_post_s: float = 0.0
    # Seconds per autograd operation of a stage that a zero-bubble schedule's split backward
    # adds (torch walks the stage's autograd graph in Python to split it).
    split_backward_node_s: float = 0.0
    # Seconds per autograd operation of a stage that selective recomputation adds, forward and
    # again when it recomputes (its dispatch mode runs in Python for every operation; on a GPU
    # the host's time overlaps the kernels': 0).
    selective_node_s: float = 0.0
    # Bus bandwidth of an all-reduce within a node, bytes/s (0: the intra-node link's).
    allreduce_bandwidth: float = 0.0
    # What each all-reduce of a data-parallel step pays within a node beyond its latency and
    # bytes: started after compute, its threads wake on cores the training keeps busy, and DDP
    # keeps its buckets' books. Paid per DDP bucket and by the loss's all-reduce (measured:
    # pipec.calibration.probe; pipec.cost.model.data_parallel_collectives).
    step_collective_s: float = 0.0
    # What DDP adds a step per gradient tensor within a node: its reducer's autograd hook marks
    # each one ready, on the cores the backward computes on (measured: pipec.calibration.probe).
    gradient_tensor_s: float = 0.0
    # What an all-reduce blocking in the middle of a pass costs within a node (a synchronized
    # BatchNorm's, forward and backward): blocking_collective_s + blocking_drift · √T, T the
    # seconds of compute since the one before (the replicas drift apart in between; measured:
    # pipec.calibration.allreduce_times, fitted by pipec.calibration.runtime_fit.blocking_fit).
    # 0, 0: not measured, and the all-reduce's latency and step_collective_s stand for it.
    blocking_collective_s: float = 0.0
    blocking_drift: float = 0.0  # seconds per √second
    # Host bytes per operation autograd records (its graph's node, the records and tensor
    # objects of what it saves), held while a micro-batch is in flight: counted where the
    # device's memory is the host's (CPU); 0 elsewhere.
    graph_node_bytes: float = 0.0
    # Host bytes the CPU math library (oneDNN) keeps for each distinct kernel it has run, JIT
    # code and cached primitives, never freed: per forward call at a shape of its own, its
    # backward's kernels included. Matrix products under --precision bf16 (oneDNN's only where
    # the CPU has bf16 instructions) and convolutions; 0 on GPUs
    # (benchmarks/studies/kernel_bytes.py).
    bf16_matmul_kernel_bytes: float = 0.0
    conv_kernel_bytes: float = 0.0
    # With several processes per node on a CPU: per n = 1 … processes − 1 of them computing
    # while the others wait in a receive, how much slower each computes than alone (measured:
    # pipec.calibration.relay; () where not measured: processor sharing alone, pipec.cost.cores).
    relay_slowdowns: tuple[float, ...] = ()
    # Seconds from a pipeline action's receive to its input's arrival where the input was sent
    # before the receiver asked (gloo's rendezvous waits for the busy sender's thread; measured:
    # pipec.calibration.receive_times; 0: not measured, the input is ready when sent).
    late_receive_s: float = 0.0
    # Per group of fewer replicas than the node's processes (a pipeline position's dp):
    # (replicas, step_collective_s, allreduce_bandwidth, gradient_tensor_s) measured on that
    # many processes while the others wait, as a pipeline's last all-reduce runs
    # (pipec.calibration.allreduce_times); a group not listed takes the figures above, measured
    # on every process.
    replica_collectives: tuple[tuple[int, float, float, float], ...] = ()
    # Streaming multiprocessors: a matrix product's output tiles run in waves of this many, and
    # the last wave's idle ones are lost (pipec.cost.model.wave_efficiency). 0: not modelled.
    compute_units: int = 0


def for_replicas(device: Device, replicas: int) -> Device:
    """``device`` with the data-parallel figures of a group of ``replicas``
    (Device.replica_collectives), where measured apart; else ``device`` itself."""
    for count, collective, bandwidth, per_tensor in device.replica_collectives:
        if count == replicas:
            return replace(device, step_collective_s=collective, allreduce_bandwidth=bandwidth,
                           gradient_tensor_s=per_tensor)
    return device


# PyTorch's cuBLAS workspace, allocated once per handle and stream through its caching allocator
# (so inside the measured peak): 32 MiB on Hopper, else CUBLAS_WORKSPACE_CONFIG's default
# 2 · 4096 KiB + 8 · 16 KiB. Training uses two handles: the forward's thread and autograd's
# backward thread. Measured on an H200 (torch 2.11, CUDA 13): 62 MiB beyond the model's terms.
_CUBLAS_WORKSPACE = {True: 32 * MIB, False: (2 * 4096 + 8 * 16) * 1024}
# Measured on an H200 (torch 2.11, CUDA 13, NCCL 2.28; benchmarks/gpu_check.sh): each process
# holds 619 MiB of CUDA context and 1,177 MiB once its NCCL communicator is up, outside the
# allocator; at a long-sequence LM's largest micro-batch the allocator reserved 3,188 MiB for
# 2,865 MiB allocated (10 % not handed out). The context and communicator depend on the CUDA
# and NCCL versions more than on the chip, so every GPU preset takes these figures.
_GPU_PROCESS_BYTES = 1177 * MIB
_GPU_FRAGMENTATION = 0.10
# Kernel efficiency by operator class on the GPU presets, from published figures, not yet
# measured by pipec: cuBLAS's large bf16/TF32 products reach 70-80 % of peak on A100 and H100
# (NVIDIA's cuBLAS benchmarks); FlashAttention-2 reaches 50-73 % forward and 63 % backward on
# an A100 (Dao, 2023) and 35 % on an H100 (Shah et al., 2024, FlashAttention-3); the rest is
# bound by memory, where ``efficiency`` hardly matters. benchmarks/gpu_check.sh's step_time
# phase measures how the three figures predict.
_GPU_MATMUL_EFFICIENCY = 0.75
_GPU_ATTENTION_EFFICIENCY = 0.5
# Each further NCCL communicator's memory, outside the allocator: 544 MiB for a two-rank group
# and 688 MiB for a larger one, on four A100s over NVLink (NVIDIA/nccl#964); NCCL's buffers
# grow with its channels, so they differ by link and version. Not yet measured by pipec:
# benchmarks/gpu_check.sh's communicators phase does.
_NCCL_PAIR_BYTES = 544 * MIB
_NCCL_GROUP_BYTES = 688 * MIB


def action_s(devices: tuple[Device, ...] | list[Device], schedule: str) -> float:
    """The slowest device's runtime time per action under ``schedule``: measured for it apart
    where it was (Device.schedule_action_s), else the device's figure for every schedule."""
    return max(dict(d.schedule_action_s).get(schedule, d.action_overhead_s) for d in devices)


@functools.cache
def cpu_has_bf16_kernels() -> bool:
    """Whether this machine's CPU has bf16 instructions (AVX512-BF16 or AMX), with which
    PyTorch runs bf16 matrix products on oneDNN's JIT-compiled kernels."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


def _gpu(name: str, fp32: float, bf16: float, bandwidth_gbs: float, memory_gib: float,
         link_gbs: float, units: int, hopper: bool = False) -> Device:
    # Inter-node: one 200 Gb/s InfiniBand HDR port per device (25 GB/s), 5 µs; NVLink 2 µs.
    return Device(name, fp32 * TFLOPS, bf16 * TFLOPS, bandwidth_gbs * GB, memory_gib * GIB,
                  link_gbs * GB, 25 * GB, 2e-6, 5e-6, kernel_overhead_s=8e-6, efficiency=0.6,
                  process_bytes=_GPU_PROCESS_BYTES, runtime_bytes=2 * _CUBLAS_WORKSPACE[hopper],
                  fragmentation=_GPU_FRAGMENTATION, matmul_efficiency=_GPU_MATMUL_EFFICIENCY,
                  attention_efficiency=_GPU_ATTENTION_EFFICIENCY,
                  communicator_bytes=_NCCL_PAIR_BYTES, group_communicator_bytes=_NCCL_GROUP_BYTES,
                  compute_units=units)


# The last argument: the chip's streaming multiprocessors (NVIDIA's whitepapers: V100 80,
# A100 108, H100 and H200 SXM 132, L4 58, RTX 4090 128).
PRESETS: dict[str, Device] = {
    # V100 SXM2 has no bf16: its fp16 tensor cores (125 TFLOP/s) stand in for mixed precision.
    "v100-16g": _gpu("v100-16g", 15.7, 125.0, 900, 16, 150, 80),
    "v100-32g": _gpu("v100-32g", 15.7, 125.0, 900, 32, 150, 80),
    "a100-40g": _gpu("a100-40g", 19.5, 312.0, 1555, 40, 300, 108),
    "a100-80g": _gpu("a100-80g", 19.5, 312.0, 2039, 80, 300, 108),
    "h100-80g": _gpu("h100-80g", 67.0, 989.0, 3350, 80, 450, 132, hopper=True),
    "h200": _gpu("h200", 67.0, 989.0, 4800, 141, 450, 132, hopper=True),
    # PCIe cards: no NVLink, stages talk over PCIe 4.0 x16 (32 GB/s one direction).
    "l4": _gpu("l4", 30.3, 121.0, 300, 24, 32, 58),
    "rtx4090": _gpu("rtx4090", 82.6, 165.2, 1008, 24, 32, 128),
    # One CPU process talking gloo over loopback, measured on a 2-core AMD EPYC VM. Memory
    # (train.py --metrics, a 4-parameter model): each process holds 356 MiB before its model is
    # built, and the runtime allocates 0.9 MiB more while training. Links (benchmarks/links.py,
    # gloo send/recv, 4 B to 64 MiB): 140 µs and 1.9 GB/s one way. Autograd's graph
    # (benchmarks/studies/graph_bytes.py on the samples): 0.3 to 4.0 KiB per recorded
    # operation, median 1.8. oneDNN's kernels (benchmarks/studies/kernel_bytes.py): 1.6 MiB per
    # new shape of a bf16 matrix product with its backward where the CPU has AVX512-BF16 (0
    # without: bf16 then runs on
    # ATen's own kernels), 0.25 MiB per convolution.
    "cpu": Device("cpu", 0.05 * TFLOPS, 0.02 * TFLOPS, 10 * GB, 8 * GIB, 1.9 * GB, 1 * GB,
                  140e-6, 200e-6, kernel_overhead_s=20e-6, efficiency=1.0,
                  process_bytes=356 * MIB, runtime_bytes=0.9 * MIB, device_type="cpu",
                  graph_node_bytes=2048,
                  bf16_matmul_kernel_bytes=1.6 * MIB if cpu_has_bf16_kernels() else 0.0,
                  conv_kernel_bytes=0.25 * MIB),
}

DEFAULT = "a100-80g"


def load_hardware(name: str) -> Device:
    """A preset by name, or a device described by a JSON file with the fields of ``Device``."""
    if name.endswith(".json"):
        return _from_json(Path(name))
    if name not in PRESETS:
        raise ConfigError(f"unknown hardware {name!r}; presets: {', '.join(sorted(PRESETS))} "
                          "(or pass a JSON file)")
    return PRESETS[name]


def load_devices(spec: str, gpus: int) -> tuple[Device, ...]:
    """One device per rank. ``spec`` is one preset or file for every rank, or an ordered list
    ``name:count,name:count`` (heterogeneous devices, ranks in order)."""
    if "," not in spec and ":" not in spec:
        return (load_hardware(spec),) * gpus
    devices: list[Device] = []
    for item in spec.split(","):
        name, _, count = item.strip().partition(":")
        if not count.isdigit() or int(count) < 1:
            raise ConfigError(f"--hardware {spec!r}: {item!r} is not NAME:COUNT with a positive "
                              "count; e.g. a100-80g:2,v100-32g:2")
        devices += [load_hardware(name)] * int(count)
    return tuple(devices)  # as many as --gpus: pipec.planning.check_request


def _from_json(path: Path) -> Device:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"hardware file {path}: {exc}") from None
    names = [f.name for f in fields(Device)]
    optional = [f.name for f in fields(Device) if f.default is not MISSING]
    missing = [n for n in names if data.get(n) is None and n not in optional]
    if missing:
        raise ConfigError(f"hardware file {path}: missing {', '.join(missing)}; a device needs "
                          f"{', '.join(n for n in names if n not in optional)} (optional: "
                          f"{', '.join(optional)})")
    device_type = str(data.get("device_type", "cuda"))
    if device_type not in ("cuda", "cpu"):
        raise ConfigError(f"hardware file {path}: device_type {device_type!r}; use cuda or cpu")
    try:
        # schedule_action_s: {"interleaved": seconds, ...}; relay_slowdowns: a list; the
        # others numbers (null: the default, for the per-class efficiencies).
        values: dict[str, Any] = {n: float(data[n]) for n in names
                                  if n not in ("name", "device_type", "schedule_action_s",
                                               "relay_slowdowns", "replica_collectives")
                                  and data.get(n) is not None}
        values["relay_slowdowns"] = tuple(float(v) for v in data.get("relay_slowdowns", ()))
        # replica_collectives: [[replicas, wait s, bandwidth B/s, per tensor s], ...]
        values["replica_collectives"] = tuple(
            (int(d), float(c), float(b), float(t))
            for d, c, b, t in data.get("replica_collectives", ()))
        per_schedule = data.get("schedule_action_s", {})  # a mapping, or pairs (asdict)
        pairs = per_schedule.items() if isinstance(per_schedule, dict) else per_schedule
        values["schedule_action_s"] = tuple(sorted((str(k), float(v)) for k, v in pairs))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"hardware file {path}: {exc}") from None
    return Device(name=str(data["name"]), device_type=device_type, **values)
