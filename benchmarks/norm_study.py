"""Normalization under pipelining, on real data: test accuracy against the micro-batch size.

A small ResNet-style CNN trains on scikit-learn's `digits` (1,797 real 8×8 images shipped inside
the package) with a global batch of 64. The pipeline is emulated faithfully: every micro-batch of
m samples runs through the network (and so through each normalization layer) on its own, and
gradients are accumulated over the 64 / m micro-batches of a step, exactly as a pipeline stage
computes them. Normalizations:

- batchnorm-micro: BatchNorm with the statistics of one micro-batch (plain BatchNorm, pipelined);
- syncbn: BatchNorm over the whole global batch (what SyncBatchNorm gives across replicas);
- groupnorm: GroupNorm, groups as pipec chooses (largest divisor of the channels <= 32);
- none: no normalization.

    python benchmarks/norm_study.py [--epochs 8] [--seeds 3] [--workers 2]

writes benchmarks/results/norm_study.json and benchmarks/results/norm-study.png and prints the
table of docs/norm-study.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from sklearn.datasets import load_digits
from tabulate import tabulate
from torch import nn
from torch.nn import functional as F

from pipec.frontend.normalization import MAX_GROUPS

NORMS = ("batchnorm-micro", "syncbn", "groupnorm", "none")
MICRO_BATCHES = (2, 4, 8, 16, 32, 64)
GLOBAL_BATCH = 64
TEST_SIZE = 397  # the rest, 1,400 images, is the training set
RESULTS = Path(__file__).resolve().parent / "results"


def largest_divisor(value: int, limit: int) -> int:
    """The largest divisor of ``value`` that is at most ``limit``: this study's group count."""
    return max(d for d in range(1, min(value, limit) + 1) if value % d == 0)


def norm_layer(norm: str, channels: int) -> nn.Module:
    if norm in ("batchnorm-micro", "syncbn"):
        return nn.BatchNorm2d(channels)
    if norm == "groupnorm":
        return nn.GroupNorm(largest_divisor(channels, MAX_GROUPS), channels)
    return nn.Identity()


class Block(nn.Module):
    def __init__(self, norm: str, channels_in: int, channels_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.norm1 = norm_layer(norm, channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.norm2 = norm_layer(norm, channels_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(nn.Conv2d(channels_in, channels_out, 1, stride,
                                                    bias=False), norm_layer(norm, channels_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        return F.relu(self.norm2(self.conv2(out)) + self.shortcut(x))


def build(norm: str) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, 1, 1, bias=False), norm_layer(norm, 32), nn.ReLU(),
        Block(norm, 32, 32, 1), Block(norm, 32, 64, 2), Block(norm, 64, 64, 1),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fixed train/test split of the real digits."""
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(1234))
    test, train = order[:TEST_SIZE], order[TEST_SIZE:]
    return images[train], labels[train], images[test], labels[test]


def train_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, norm: str,
               micro_batch: int) -> None:
    """One step's gradient: micro-batches run separately (the whole batch at once for syncbn)."""
    size = GLOBAL_BATCH if norm == "syncbn" else micro_batch
    chunks = x.shape[0] // size
    for xs, ys in zip(x.split(size), y.split(size), strict=True):
        (F.cross_entropy(model(xs), ys) / chunks).backward()


def run(norm: str, micro_batch: int, seed: int, epochs: int) -> float:
    """Train one configuration; its test accuracy."""
    torch.set_num_threads(1)
    train_x, train_y, test_x, test_y = split()
    torch.manual_seed(seed)
    model = build(norm)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    steps_per_epoch = len(train_y) // GLOBAL_BATCH
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, epochs * steps_per_epoch)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        order = torch.randperm(len(train_y), generator=generator)
        for step in range(steps_per_epoch):
            rows = order[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH]
            optimizer.zero_grad()
            train_step(model, train_x[rows], train_y[rows], norm, micro_batch)
            optimizer.step()
            schedule.step()
    model.eval()  # BatchNorm: running statistics
    with torch.no_grad():
        return float((model(test_x).argmax(1) == test_y).float().mean())


def study(epochs: int, seeds: int, workers: int,
          progress: Callable[[str], None]) -> list[dict[str, object]]:
    configs = [(norm, m, seed) for seed in range(seeds) for norm in NORMS for m in MICRO_BATCHES]
    rows: list[dict[str, object]] = []
    with ProcessPoolExecutor(workers) as pool:
        futures = [pool.submit(run, norm, m, seed, epochs) for norm, m, seed in configs]
        for (norm, m, seed), future in zip(configs, futures, strict=True):
            rows.append({"norm": norm, "micro_batch": m, "seed": seed,
                         "accuracy": round(future.result(), 4)})
            progress(f"{len(rows)}/{len(configs)} {norm} m={m} seed={seed}: "
                     f"{rows[-1]['accuracy']:.4f}")
    return rows


def table(rows: list[dict[str, object]]) -> str:
    cells = []
    for norm in NORMS:
        line = [norm]
        for m in MICRO_BATCHES:
            values = [float(r["accuracy"]) for r in rows  # type: ignore[arg-type]
                      if r["norm"] == norm and r["micro_batch"] == m]
            spread = statistics.stdev(values) if len(values) > 1 else 0.0
            line.append(f"{100 * statistics.mean(values):.1f} ± {100 * spread:.1f}")
        cells.append(line)
    return tabulate(cells, ("normalization", *(f"m={m}" for m in MICRO_BATCHES)),
                    tablefmt="github")


def plot(rows: list[dict[str, object]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (whole, zoom) = plt.subplots(1, 2, figsize=(10, 4.0))
    for norm in NORMS:
        means, spreads = [], []
        for m in MICRO_BATCHES:
            values = [100 * float(r["accuracy"]) for r in rows  # type: ignore[arg-type]
                      if r["norm"] == norm and r["micro_batch"] == m]
            means.append(statistics.mean(values))
            spreads.append(statistics.stdev(values) if len(values) > 1 else 0.0)
        for axes in (whole, zoom) if norm != "none" else (whole,):
            axes.errorbar(MICRO_BATCHES, means, yerr=spreads, marker="o", capsize=3, label=norm)
    for axes, title in ((whole, "all"), (zoom, "normalized networks, zoomed")):
        axes.set_xscale("log", base=2)
        axes.set_xticks(MICRO_BATCHES, [str(m) for m in MICRO_BATCHES])
        axes.set_xlabel("micro-batch size m (global batch 64)")
        axes.set_title(f"digits: {title}")
        axes.grid(alpha=0.3)
    whole.set_ylabel("test accuracy, % (mean ± std over seeds)")
    whole.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120, metadata={"Software": None})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--replot", action="store_true",
                        help="redraw the plot and table from results/norm_study.json, no training")
    args = parser.parse_args()
    if args.replot:
        rows = json.loads((RESULTS / "norm_study.json").read_text())["results"]
        plot(rows, RESULTS / "norm-study.png")
        print(table(rows))
        return
    started = time.perf_counter()
    rows = study(args.epochs, args.seeds, args.workers, lambda line: print(line, flush=True))
    config = {"global_batch": GLOBAL_BATCH, "epochs": args.epochs, "train_size": 1797 - TEST_SIZE,
              "test_size": TEST_SIZE, "optimizer": "sgd lr 0.05 momentum 0.9 wd 5e-4, cosine"}
    (RESULTS / "norm_study.json").write_text(json.dumps(
        {"dataset": "digits", "config": config, "results": rows}, indent=1) + "\n")
    plot(rows, RESULTS / "norm-study.png")
    print(table(rows))
    print(f"{len(rows)} runs in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
