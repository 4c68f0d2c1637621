"""Which side of a boundary pays its bytes: a 2-device 1F1B pipeline whose stages hold their
core for a fixed time per action, one stage slower than the other, sending one tensor of a few
bytes or of several MiB per micro-batch; measured, then predicted by pipec's simulator two ways.

    python benchmarks/studies/link_side.py [--work-ms 4 8] [--mib 4] [--micro-batches 8]
                                           [--rounds 3]

Why: torch's runtime posts a send and goes on, and gloo's send is a rendezvous (it starts when
the receiver asks). So a transfer delays its receiver, not its sender: where the receiver is
the slower stage its inputs were sent before it asked, and each waits for its transfer after
the ask. pipec's simulator puts the transfer on the link (planning.evaluate.transfer_s); before
the eighteenth session the sender's actions held it.

The model's inputs are this machine's: the runtime probe's figures for 2 processes (pipec's
cache, measured once where missing) and the toy stage's own forward and backward, timed here
in one process (its multiply and copies, which grow with the bytes too). Each round times every
configuration's step (the median of 12 after 2 warm-ups), in alternating order.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tabulate import tabulate
from torch import nn
from torch.distributed import pipelining

from pipec.calibration.by_default import measure_locally
from pipec.cost.hardware import Device, action_s, load_devices
from pipec.planning.simulate import simulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from busy_links import _Hold, join_pair, median_step_s, on_two_processes
from commands import ROOT

Config = tuple[float, float, int]  # stage 0's and stage 1's ms per action, bytes a micro-batch


class _Stage(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.weight, self.seconds = nn.Parameter(torch.ones(1)), seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Hold.apply(x * self.weight, self.seconds, True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-ms", type=float, nargs=2, default=[4.0, 8.0],
                        help="the faster and the slower stage's hold per action (4 8)")
    parser.add_argument("--mib", type=float, default=4.0, help="the large tensor (4 MiB)")
    parser.add_argument("--micro-batches", type=int, default=8, help="(8)")
    parser.add_argument("--rounds", type=int, default=3, help="(3)")
    args = parser.parse_args()
    fast, slow = args.work_ms
    sizes = (16, int(args.mib * 2**20))
    configs = [(w0, w1, size) for w0, w1 in ((fast, slow), (slow, fast)) for size in sizes]
    measured = _measure(configs, args)
    device = _device()
    rows, added = [], []
    for (w0, w1, size), steps in measured.items():
        now, before = (_predicted_s(device, w0, w1, size, args.micro_batches, link)
                       for link in (True, False))
        step = statistics.median(steps)
        slower = "receiver" if w1 > w0 else "sender"
        rows.append((slower, f"{size:,}", f"{step * 1e3:.1f}", f"{now * 1e3:.1f}",
                     f"{now / step - 1:+.1%}", f"{before * 1e3:.1f}", f"{before / step - 1:+.1%}"))
        added.append((slower, step, now, before))
    # What the large tensor adds to the small one's step, per side (rows in pairs).
    growth = [(small[0], *(f"{(b - a) * 1e3:.1f}" for a, b in zip(small[1:], large[1:],
                                                                   strict=True)))
              for small, large in zip(added[::2], added[1::2], strict=True)]
    print(f"2 processes, 1F1B, {args.micro_batches} micro-batches, stages holding {fast:g} and "
          f"{slow:g} ms per action, median over {args.rounds} rounds; links: "
          f"{device.intra_node_latency_s * 1e6:.0f} µs + bytes / "
          f"{device.intra_node_bandwidth / 1e9:.2f} GB/s, late receive "
          f"{device.late_receive_s * 1e6:.0f} µs\n")
    print(tabulate(rows, ("slower stage", "bytes a micro-batch", "measured ms",
                          "transfer on the link ms", "error", "sender pays ms", "error"),
                   tablefmt="github"))
    print(f"\nWhat {args.mib:g} MiB a micro-batch adds to the step, ms:\n")
    print(tabulate(growth, ("slower stage", "measured", "transfer on the link", "sender pays"),
                   tablefmt="github"))


def _measure(configs: list[Config], args: argparse.Namespace) -> dict[Config, list[float]]:
    figures: dict[Config, list[float]] = on_two_processes(_worker, configs, args)
    return figures


def _worker(rank: int, port: int, configs: list[Config], args: argparse.Namespace,
            results: Any) -> None:
    join_pair(rank, port)
    steps: dict[Config, list[float]] = {}
    for round_ in range(args.rounds):
        for config in configs if round_ % 2 == 0 else configs[::-1]:
            steps.setdefault(config, []).append(_step_s(rank, config, args.micro_batches))
    if rank == 0:
        results.put(steps)
    dist.destroy_process_group()


def _step_s(rank: int, config: Config, micro_batches: int) -> float:
    stage = pipelining.PipelineStage(_Stage(config[rank] / 1e3), rank, 2, torch.device("cpu"))
    runner = pipelining.Schedule1F1B(stage, micro_batches, loss_fn=lambda out, _: out.sum())
    return median_step_s(runner, rank, torch.ones(micro_batches, config[2] // 4))


def _device() -> Device:
    """This machine's CPU with the runtime probe's figures for 2 processes (any model's
    measurement brings them; the MLP sample's is quick)."""
    devices = load_devices("cpu", 2)
    local = measure_locally(Path(ROOT / "samples" / "mlp.py"), devices, 2, 64, "fp32", "auto")
    if local is None:
        raise SystemExit("this machine's CPU could not be measured")
    return local.devices[0]


def _stage_ops_s(size: int) -> tuple[float, float]:
    """The toy stage's own forward and backward on one micro-batch of ``size`` bytes, in this
    process, without the hold."""
    stage, forward, backward = _Stage(0.0), [], []
    for _ in range(25):
        x = torch.ones(1, size // 4, requires_grad=True)
        started = time.perf_counter()
        out = stage(x)
        middle = time.perf_counter()
        out.backward(torch.ones_like(out))
        forward.append(middle - started)
        backward.append(time.perf_counter() - middle)
    return statistics.median(forward[5:]), statistics.median(backward[5:])


def _predicted_s(device: Device, w0: float, w1: float, size: int, micro_batches: int,
                 on_link: bool) -> float:
    """The step as pipec's simulator times it: each action the hold, the stage's own work and
    the runtime's time per action and per post; the transfer on the link (the present model)
    or in the sending action (before)."""
    ops_fwd, ops_bwd = _stage_ops_s(size)
    runtime = action_s((device,), "1f1b") + device.p2p_post_s  # each action posts one link
    one_way = device.intra_node_latency_s + size / device.intra_node_bandwidth
    fwd = [w / 1e3 + ops_fwd + runtime for w in (w0, w1)]
    bwd = [w / 1e3 + ops_bwd + runtime for w in (w0, w1)]
    if on_link:
        return simulate("1f1b", fwd, bwd, micro_batches, 2, timeline=False,
                        late_receive_s=device.late_receive_s,
                        transfer_s=([one_way, 0.0], [0.0, one_way])).iteration_s
    fwd[0] += one_way  # stage 0 paid its boundary both ways, as stage_times charged it
    bwd[0] += one_way
    return simulate("1f1b", fwd, bwd, micro_batches, 2, timeline=False,
                    late_receive_s=device.late_receive_s).iteration_s


if __name__ == "__main__":
    main()
