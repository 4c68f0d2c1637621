"""What the emitted script's DataLoader workers take off the step: one training process on a
dataset with per-item work (benchmarks/models/augmented_images.py), read in the training process
(--data-workers 0) against one loader worker, in turns.

    python benchmarks/data_loader.py [--steps 40] [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from commands import PIPEC, ROOT, mean_samples_per_s, run
from tabulate import tabulate

MODEL = ROOT / "benchmarks" / "models" / "augmented_images.py"


def samples_per_s(out: Path, steps: int, workers: int) -> float:
    printed = run([sys.executable, str(out / "train.py"), "--steps", str(steps),
                   "--data-workers", str(workers)], cwd=out)
    return mean_samples_per_s(printed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "o"
        run([*PIPEC, "compile", str(MODEL), "--gpus", "1", "--hardware", "cpu", "--measure",
             "off", "--batch-size", str(args.batch_size), "-o", str(out)])
        figures: dict[int, list[float]] = {0: [], 1: []}
        for _ in range(args.rounds):
            for workers in figures:
                figures[workers].append(samples_per_s(out, args.steps, workers))
    base = statistics.median(figures[0])
    rows = [(workers, " ".join(f"{f:.0f}" for f in runs), f"{statistics.median(runs):.0f}",
             f"{statistics.median(runs) / base:.2f}×") for workers, runs in figures.items()]
    table = tabulate(rows, headers=("--data-workers", "samples/s per run",
                                    "median samples/s", "against 0"), tablefmt="github")
    print(table)
    if args.out:
        args.out.write_text(f"# Loader workers on a dataset with per-item work\n\n`python "
                            f"benchmarks/data_loader.py --steps {args.steps} --rounds "
                            f"{args.rounds}`: one training process (OMP_NUM_THREADS=1), "
                            f"global batch {args.batch_size}, "
                            "`benchmarks/models/augmented_images.py`.\n\n" + table + "\n")


if __name__ == "__main__":
    main()
