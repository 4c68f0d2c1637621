"""The cost model's figures: FLOPs against analytic counts, saved activations against autograd,
and speed on the GPT-2 XL shape.

    python benchmarks/cost_model.py            # everything (about a minute)
    python benchmarks/cost_model.py --skip-speed
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tabulate import tabulate

from pipec.calibration.profile import measured_saved_bytes
from pipec.frontend.annotate import CostGraph, annotate
from pipec.frontend.loader import load_model_file
from pipec.frontend.trace import batch_inputs, trace_model

ROOT = Path(__file__).resolve().parent.parent
ZOO = ROOT / "benchmarks" / "zoo"
SAMPLES = ROOT / "samples"


def analyse(path: Path) -> CostGraph:
    spec = load_model_file(path)
    return annotate(trace_model(spec), spec)


def flops_table() -> str:
    """GPT-2 XL: T(24·L·d² + 2·d·V) + 4·L·T²·d forward, 2× backward; ResNet-50: 8.18 GFLOP."""
    layers, width, tokens, vocab = 48, 1600, 1024, 50257
    gpt_forward = (tokens * (24 * layers * width**2 + 2 * width * vocab)
                   + 4 * layers * tokens**2 * width)
    gpt_params = (vocab * width + tokens * width + layers * (12 * width**2 + 13 * width)
                  + 2 * width + width * vocab)
    rows = []
    for name, path, forward, params in (
            ("GPT-2 XL shape, 1 sequence", ZOO / "gpt2_xl.py", gpt_forward, gpt_params),
            ("ResNet-50, 1 image 224²", ZOO / "resnet50.py", 8.18e9, 25_557_032)):
        graph = analyse(path)
        fwd = sum(n.fwd_flops.at(1) for n in graph.nodes)
        bwd = sum(n.bwd_flops.at(1) for n in graph.nodes)
        rows.append((name, f"{fwd / 1e9:,.2f}", f"{forward / 1e9:,.2f}",
                     f"{fwd / forward - 1:+.2%}", f"{bwd / fwd:.3f}",
                     f"{graph.total_params:,}", f"{params:,}"))
    return tabulate(rows, ("model", "fwd GFLOP (pipec)", "fwd GFLOP (reference)", "error",
                           "bwd / fwd", "params (pipec)", "params (reference)"),
                    tablefmt="github")


def real_saved_bytes(path: Path, batch: int) -> int:
    """What autograd really saves on CPU for one forward of the model file's model."""
    spec = load_model_file(path)
    torch.manual_seed(0)
    return measured_saved_bytes(spec.build_model(), batch_inputs(spec, batch)[0])


def activation_table(batch: int = 16) -> str:
    rows = []
    for path in sorted(SAMPLES.glob("*.py")):
        predicted = sum(n.saved_bytes.at(batch) for n in analyse(path).nodes)
        real = real_saved_bytes(path, batch)
        rows.append((path.name, f"{predicted / 2**20:.3f}", f"{real / 2**20:.3f}",
                     f"{predicted / real - 1:+.1%}"))
    return tabulate(rows, (f"sample (batch {batch})", "saved MiB (pipec, meta)",
                           "saved MiB (autograd, CPU)", "error"), tablefmt="github")


# Runs a command and prints its peak RSS in KiB (a fresh parent, so only that command counts).
PEAK_RSS = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, "
            "capture_output=True); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def timed(command: list[str]) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of a command."""
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", PEAK_RSS, *command], check=True,
                            capture_output=True, text=True)
    return time.perf_counter() - started, int(result.stdout.split()[-1]) / 1024


def speed_table() -> str:
    pipec = [sys.executable, "-m", "pipec"]
    model = str(ZOO / "gpt2_xl.py")
    with tempfile.TemporaryDirectory() as out:
        runs = [("pipec inspect gpt2_xl.py", [*pipec, "inspect", model, "--depth", "1"], 10),
                ("pipec compile gpt2_xl.py --gpus 8",
                 [*pipec, "compile", model, "--gpus", "8", "--batch-size", "32", "-o",
                  f"{out}/xl"], 20)]
        rows = []
        for name, command, target in runs:
            seconds, rss = timed(command)
            rows.append((name, f"{seconds:.1f}", f"≤ {target}", f"{rss:,.0f}", "≤ 2,048"))
    return tabulate(rows, ("command (whole process)", "seconds", "target", "peak RSS MiB",
                           "target"), tablefmt="github")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-speed", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(flops_table(), end="\n\n")
    print(activation_table(), end="\n\n")
    if not args.skip_speed:
        print(speed_table())


if __name__ == "__main__":
    main()
