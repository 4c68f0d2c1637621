"""Point-to-point latency and bandwidth between two local processes, as the pipeline's stages
send activations: blocking send/recv over torch.distributed (gloo on CPUs, NCCL on GPUs).

    python benchmarks/links.py [--backend gloo|nccl] [--rounds 20]

Two processes (forked, one thread each) ping-pong tensors from 4 bytes to 64 MiB; each size's
one-way time is half the median round trip. A least-squares line, time = latency +
bytes / bandwidth, is fitted over every size, and printed with its worst relative error: the
figures `intra_node_latency_s` and `intra_node_bandwidth` of a hardware preset mean.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tabulate import tabulate

SIZES = [4 * 4**k for k in range(13)]  # 4 B … 64 MiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    results = mp.get_context("fork").SimpleQueue()
    workers = [mp.get_context("fork").Process(
        target=_worker, args=(rank, port, args.backend, args.rounds, results)) for rank in (0, 1)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    one_way = results.get()
    _report(one_way)


def _worker(rank: int, port: int, backend: str, rounds: int, results: object) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    dist.init_process_group(backend, rank=rank, world_size=2)
    one_way = {}
    for size in SIZES:
        tensor = torch.zeros(size // 4, dtype=torch.float32, device=device)
        trips = [_round_trip(rank, tensor) for _ in range(rounds + 2)][2:]  # 2 warm-ups
        one_way[size] = statistics.median(trips) / 2
    if rank == 0:
        results.put(one_way)  # type: ignore[attr-defined]
    dist.destroy_process_group()


def _round_trip(rank: int, tensor: torch.Tensor) -> float:
    dist.barrier()
    started = time.perf_counter()
    if rank == 0:
        dist.send(tensor, 1)
        dist.recv(tensor, 1)
    else:
        dist.recv(tensor, 0)
        dist.send(tensor, 0)
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
    return time.perf_counter() - started


def _report(one_way: dict[int, float]) -> None:
    sizes = np.array(sorted(one_way), dtype=float)
    seconds = np.array([one_way[int(s)] for s in sizes])
    # Least squares on relative errors: small messages weigh as much as large ones.
    weights = 1 / seconds
    design = np.stack([np.ones_like(sizes), sizes], axis=1) * weights[:, None]
    (latency, per_byte), *_ = np.linalg.lstsq(design, seconds * weights, rcond=None)
    fitted = latency + per_byte * sizes
    print(tabulate([(f"{int(s):,}", f"{t * 1e6:,.1f}", f"{f * 1e6:,.1f}", f"{f / t - 1:+.0%}")
                    for s, t, f in zip(sizes, seconds, fitted, strict=True)],
                   ("bytes", "one way µs (median)", "fitted µs", "fit error"), tablefmt="github"))
    worst = float(np.max(np.abs(fitted / seconds - 1)))
    print(f"\nlatency {latency * 1e6:.1f} µs, bandwidth {1 / per_byte / 1e9:.2f} GB/s "
          f"(worst fit error {worst:.0%})")


if __name__ == "__main__":
    main()
