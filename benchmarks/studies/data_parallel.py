"""What DistributedDataParallel costs a step, measured on real models, against what pipec
charges for it.

Per model (the samples and benchmarks/models), pipec compiles a data-parallel plan on 2 CPU
processes (`--pp 1 --gpus 2 --norm keep`, one micro-batch of --micro-batch per replica),
measuring this machine as `pipec compile` does by default. Its charge is plan.json's step
terms `all_reduce` (the buckets' all-reduces, DDP's work per gradient tensor) and `runtime`
(the loss's all-reduce). Then 2 forked gloo processes time a training step of the model
(forward, loss, backward) alone and wrapped in DDP as train.py wraps it, with the loss
all-reduced: pairs of steps, one of each, both processes starting each step together, for
about --seconds (at least --pairs pairs). What DDP adds is the median of the pairs'
differences, each process's step timed to its own end (the DDP step's last all-reduce waits
for the other process: the lead one takes on the other, which pipec charges too), averaged over
the two: the machine's speed drifts by more than DDP's cost over a few seconds, so only steps
side by side in time are compared.

    python benchmarks/studies/data_parallel.py [--micro-batch 4] [--pairs 10] [--seconds 10]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tabulate import tabulate
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from pipec.frontend.loader import load_model_file
from pipec.frontend.trace import batch_inputs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
from commands import PIPEC, ROOT, run

# wide_decoder is left out: 3.5 GiB of weights, measuring it alone takes over 20 minutes here.
MODELS = (*(ROOT / "samples" / f"{name}.py" for name in ("mlp", "imbalanced", "gpt", "resnet")),
          *(ROOT / "benchmarks" / "models" / f"{name}.py"
            for name in ("deep_mlp", "long_lm", "unet")))


def predicted_s(model: Path, micro_batch: int, work: Path) -> tuple[float, dict[str, Any]]:
    """pipec's charge for DDP on 2 processes, and the plan's data-parallel figures."""
    out = work / model.stem
    run([*PIPEC, "compile", str(model), "--gpus", "2", "--pp", "1", "--hardware", "cpu",
         "--norm", "keep", "--batch-size", str(2 * micro_batch), "--micro-batch",
         str(micro_batch), "-o", str(out)])
    predicted = json.loads((out / "plan.json").read_text())["predicted"]
    terms = predicted["step_terms"]
    return terms["all_reduce"] + terms["runtime"], predicted["data_parallel"]


def measured_s(model: Path, micro_batch: int, pairs: int, seconds: float) -> tuple[float, int]:
    """What DDP adds to a step of ``model`` on 2 forked processes, and its gradient tensors."""
    context = mp.get_context("fork")
    results = context.SimpleQueue()
    port = _free_port()
    workers = [context.Process(target=_worker,
                               args=(rank, port, model, micro_batch, pairs, seconds, results))
               for rank in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    answers = [results.get() for _ in workers]
    if any(isinstance(a, str) for a in answers):
        raise SystemExit(next(a for a in answers if isinstance(a, str)))
    return statistics.mean(a[0] for a in answers), answers[0][1]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(rank: int, port: int, model: Path, micro_batch: int, pairs: int, seconds: float,
            results: Any) -> None:
    try:
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2)
        results.put(_ddp_extra(model, micro_batch, pairs, seconds))
        dist.destroy_process_group()
    except Exception as exc:  # reported to the parent
        results.put(f"rank {rank}, {model.name}: {exc!r}")


def _ddp_extra(model: Path, micro_batch: int, pairs: int, seconds: float) -> tuple[float, int]:
    spec = load_model_file(model)
    torch.manual_seed(0)
    plain = spec.build_model().train()
    replicated = DistributedDataParallel(plain, gradient_as_bucket_view=True)
    inputs, targets = batch_inputs(spec, micro_batch)
    loss_fn = getattr(spec.module, "loss_fn", F.cross_entropy)

    def step(module: torch.nn.Module, synchronized: bool) -> Callable[[], None]:
        def one() -> None:
            plain.zero_grad(set_to_none=True)
            loss = loss_fn(module(*inputs), targets)
            loss.backward()
            if synchronized:
                dist.all_reduce(loss.detach())
        return one

    step(replicated, True)()  # warm: DDP builds its buckets in its first steps
    step(replicated, True)()
    start = time.perf_counter()
    step(plain, False)()  # how many pairs fill the time: rank 0's count
    count = torch.tensor([max(pairs, round(seconds / 2 / (time.perf_counter() - start)))])
    dist.broadcast(count, 0)
    extra = [_step_s(step(replicated, True)) - _step_s(step(plain, False))
             for _ in range(int(count))]
    return statistics.median(extra), len(list(plain.parameters()))


def _step_s(function: Callable[[], None]) -> float:
    """One step, both processes starting together, until this one ends: the plain step's own
    compute, the DDP step's until its last all-reduce, which waits for the other's lead."""
    dist.barrier()
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    rows, errors = [], []
    with tempfile.TemporaryDirectory() as work:
        for model in MODELS:
            print(f"{model.stem}: compiling, then measuring", file=sys.stderr, flush=True)
            predicted, figures = predicted_s(model, args.micro_batch, Path(work))
            measured, tensors = measured_s(model, args.micro_batch, args.pairs, args.seconds)
            errors.append(predicted / measured - 1)
            rows.append((model.stem, tensors, f"{predicted * 1e3:.2f}", f"{measured * 1e3:.2f}",
                         f"{errors[-1]:+.0%}"))
            print(f"  charged {rows[-1][2]} ms, measured {rows[-1][3]} ms", file=sys.stderr,
                  flush=True)
    print(f"per gradient tensor {figures['per_gradient_tensor_s'] * 1e6:.1f} µs, wait per "
          f"all-reduce {figures['wait_per_all_reduce_s'] * 1e3:.2f} ms (this machine, measured)")
    print(tabulate(rows, ("model", "gradient tensors", "pipec charges (ms)", "measured (ms)",
                          "error"), tablefmt="github"))
    print(f"median error {statistics.median(errors):+.0%}, worst "
          f"{max(errors, key=abs):+.0%}")


if __name__ == "__main__":
    main()
