"""The training runtime on this machine's GPUs, one process each, over NCCL: what the GPU
presets' data sheets cannot know. pipec.calibration.by_default caches it beside the CPU's
(pipec.calibration.probe), and fits the same terms from it (pipec.calibration.runtime_fit):

- **links**: blocking send/recv between GPUs 0 and 1 at four sizes up to 64 MiB (NVLink's
  bandwidth shows only in large transfers), as latency + bytes / bandwidth;
- **per action**: the pipelining runtime's host time per forward or backward action, beside a
  plain layer's (pipec.calibration.action_times);
- **per action, by schedule**: each schedule's step of a 2-GPU pipeline of a 4-wide layer,
  waited for on the GPU: the runtime's sends, receives and bookkeeping between actions;
- **all-reduce**: 64 MiB over every GPU, as bus bandwidth 2(d−1)/d · bytes / seconds;
- **per step**: an all-reduce of one value, waited for (train.py shares the loss each step).

What the CPU probe measures of processes sharing cores (relayed compute, late receives,
blocking all-reduces, DDP's steps in context) does not apply to a GPU each; the presets keep
those terms. The same probes run with ``device_type="cpu"`` on gloo, which is how the tests
check them on a machine without a GPU.
"""

from __future__ import annotations

import datetime
import os
import statistics
from typing import Any

import torch
import torch.distributed as dist

from pipec.calibration.action_times import action_overhead_s, schedule_steps
from pipec.calibration.allreduce_times import allreduce_s, step_s
from pipec.calibration.probe import (
    TIMEOUT_S,
    RuntimeFigures,
    fit_link,
    links_one_way,
    run_workers,
)

GPU_LINK_SIZES = (4, 1 << 20, 16 << 20, 64 << 20)
GPU_ALLREDUCE_BYTES = 64 << 20


def probe_gpu_runtime(processes: int, device_type: str = "cuda") -> RuntimeFigures:
    """Spawn ``processes`` workers, one device each (rank_device), and measure. Spawned, not
    forked: CUDA cannot run in a child forked after it started here, as it has once pipec
    measured the model."""
    if processes < 2:
        raise ValueError(f"the GPU runtime probe needs 2 processes or more, not {processes}")
    by_rank = run_workers("spawn", _worker, processes, device_type)
    latency, bandwidth = fit_link(by_rank[0]["links"])
    seconds = max(f["allreduce"] for f in by_rank)
    return RuntimeFigures(
        processes, latency, bandwidth, statistics.median(f["action"] for f in by_rank[:2]),
        2 * (processes - 1) / processes * GPU_ALLREDUCE_BYTES / seconds,
        max(f["step"] for f in by_rank),
        {s: max(by_rank[0]["schedules"][s], by_rank[1]["schedules"][s])
         for s in by_rank[0]["schedules"]},
        split_backward_node_s=0.0, data_parallel_s=(), selective_node_s=0.0, blocking_s=(),
        device_type=device_type)


def rank_device(rank: int, device_type: str) -> torch.device:
    """Rank ``rank``'s device: GPU rank mod the GPUs here (ranks share GPUs only where there are
    fewer GPUs than processes, as in benchmarks/gpu_check.py), or the CPU."""
    if device_type != "cuda":
        return torch.device("cpu")
    return torch.device("cuda", rank % torch.cuda.device_count())


def _worker(rank: int, world: int, port: int, device_type: str, results: Any) -> None:
    try:
        device = rank_device(rank, device_type)
        _join(rank, world, port, device)
        results.put((rank, {"links": links_one_way(rank, device, GPU_LINK_SIZES),
                            "action": action_overhead_s(rank, device),
                            "schedules": schedule_steps(rank, device),
                            "allreduce": allreduce_s(device, GPU_ALLREDUCE_BYTES),
                            "step": step_s(device)}))
        dist.destroy_process_group()
    except Exception as exc:  # reported to the parent, which raises it
        results.put((rank, f"rank {rank}: {exc!r}"))


def _join(rank: int, world: int, port: int, device: torch.device) -> None:
    """Join the probe's process group: NCCL on a GPU, gloo on the CPU (one thread a process)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    if device.type != "cuda":
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
        return
    if world > torch.cuda.device_count():
        # NCCL refuses two ranks of one host on one GPU; as two hosts it lets them share it.
        os.environ["NCCL_HOSTID"] = f"pipec-probe-{rank}"
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timeout,
                            device_id=device)
