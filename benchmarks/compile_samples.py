"""Time `pipec compile` of each sample: the first command, which measures the model on this
machine (`--measure auto`, a fresh cache), then the command and the passes alone (warm process)
reading that cache.

    python benchmarks/compile_samples.py [--gpus 4] [--batch-size 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tabulate import tabulate

from pipec.driver import CompileOptions, compile_model

SAMPLES = Path(__file__).resolve().parent.parent / "samples"


def command_seconds(model: Path, out: Path, args: argparse.Namespace) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pipec", "compile", str(model), "-o", str(out),
                    "--gpus", str(args.gpus), "--batch-size", str(args.batch_size),
                    "--hardware", "cpu"], check=True, capture_output=True)
    return time.perf_counter() - started


def passes_seconds(model: Path, out: Path, args: argparse.Namespace) -> float:
    started = time.perf_counter()
    compile_model(CompileOptions(model=model, out=out, gpus=args.gpus,
                                 batch_size=args.batch_size, hardware="cpu"))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["PIPEC_CACHE_DIR"] = str(Path(tmp) / "cache")  # the first compile measures
        out = Path(tmp) / "out"
        for model in sorted(SAMPLES.glob("*.py")):
            first = command_seconds(model, out, args)
            command = [command_seconds(model, out, args) for _ in range(args.repeats)]
            passes_seconds(model, out, args)  # warm: torch's lazy imports
            passes = [passes_seconds(model, out, args) for _ in range(args.repeats)]
            rows.append((model.name, f"{first:.1f}", f"{statistics.median(command):.2f}",
                         f"{statistics.median(passes):.2f}"))
    print(f"pipec compile --gpus {args.gpus} --batch-size {args.batch_size} --hardware cpu; "
          f"cached: median of {args.repeats}")
    print(tabulate(rows, ("sample", "first command s (measures)", "cached command s",
                          "cached passes s (warm process)"), tablefmt="github"))


if __name__ == "__main__":
    main()
