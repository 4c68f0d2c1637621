"""The calibrated CPU time model against measurement, stage by stage.

For each sample: `pipec profile` it (CPU), compile it for 2 pipeline devices with that
calibration, then run every emitted stage for real on the CPU at the plan's micro-batch size and
time its forward and backward (median of --repeats, the stages taking turns), against the plan's
predicted compute time (`compute_s`). This machine's speed drifts by tens of percent over
seconds, so the whole check runs --rounds times and reports each stage's median error.

    python benchmarks/calibration.py [--rounds 3] [--repeats 30] [--gpus 2] [--batch-size 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from tabulate import tabulate

from pipec.calibration.profile import profile_model
from pipec.codegen.output_dir import emitted_modules
from pipec.cost.calibration_file import save_calibration
from pipec.driver import CompileOptions, compile_model

SAMPLES = Path(__file__).resolve().parent.parent / "samples"


def stage_inputs(stages: list[torch.nn.Module], first: tuple[torch.Tensor, ...]
                 ) -> list[tuple[torch.Tensor, ...]]:
    """Each stage's real inputs: the micro-batch pushed through the stages before it."""
    inputs = [first]
    with torch.no_grad():
        for stage in stages[:-1]:
            output = stage(*inputs[-1])
            inputs.append(output if isinstance(output, tuple) else (output,))
    return inputs


def stage_step(stage: torch.nn.Module, inputs: tuple[torch.Tensor, ...],
               specs: tuple[Any, ...]) -> Callable[[], None]:
    """One forward and backward of ``stage``, as a pipeline step runs it."""
    def step() -> None:
        leaves = [t.detach().requires_grad_(grad) for t, (_, _, grad) in zip(inputs, specs,
                                                                             strict=True)]
        output = stage(*leaves)
        outputs = [o for o in (output if isinstance(output, tuple) else (output,))
                   if o.requires_grad]
        torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])
    return step


def time_stages(steps: list[Callable[[], None]], repeats: int) -> list[float]:
    """Median seconds of each step, the steps taking turns (so that the machine's drift falls
    on all of them alike), after a warm-up."""
    times: list[list[float]] = [[] for _ in steps]
    for repeat in range(repeats + 1):
        for step, seconds in zip(steps, times, strict=True):
            started = time.perf_counter()
            step()
            if repeat:
                seconds.append(time.perf_counter() - started)
    return [statistics.median(seconds) for seconds in times]


def measure(sample: Path, args: argparse.Namespace, tmp: Path) -> list[Row]:
    """One round: profile ``sample``, compile it with that calibration, time its stages."""
    calibration, _ = profile_model(sample, args.batch_size)
    save_calibration(calibration, tmp / "calibration.json")
    out = tmp / sample.stem
    compile_model(CompileOptions(model=sample, out=out, gpus=args.gpus, pp=args.gpus,
                                 schedule="1f1b", batch_size=args.batch_size, hardware="cpu",
                                 calibration=tmp / "calibration.json", force=True))
    plan = json.loads((out / "plan.json").read_text())
    with emitted_modules(out) as (user, emitted):
        steps = stage_steps(user, emitted, plan["micro_batch"])
    measured = time_stages(steps, args.repeats)
    return [Row(sample.name, index, plan["micro_batch"], plan["stages"][index]["compute_s"],
                seconds) for index, seconds in enumerate(measured)]


def stage_steps(user: ModuleType, emitted: ModuleType, micro_batch: int
                ) -> list[Callable[[], None]]:
    """Each emitted stage's forward and backward on its real inputs at ``micro_batch``."""
    torch.manual_seed(0)
    model = user.build_model()
    emitted.rewrite_norms(model)
    stages = [cls(model) for cls in emitted.STAGES]
    batch, _ = user.sample_batch(micro_batch)
    first = (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)
    return [stage_step(stage, inputs, emitted.STAGES[index].INPUTS or tuple(
        (None, None, False) for _ in inputs)) for index, (stage, inputs) in enumerate(
            zip(stages, stage_inputs(stages, first), strict=True))]


@dataclass(frozen=True)
class Row:
    sample: str
    stage: int
    micro_batch: int
    predicted_s: float
    measured_s: float

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1


def summary(rows: list[Row]) -> list[tuple[Any, ...]]:
    """Per stage: the median error over the rounds, and how far the measured time itself
    moved between rounds (the machine's drift, not the model's error)."""
    by_stage: dict[tuple[str, int], list[Row]] = {}
    for row in rows:
        by_stage.setdefault((row.sample, row.stage), []).append(row)
    return [(sample, stage, " ".join(f"{r.error:+.1%}" for r in runs),
             f"{statistics.median(r.error for r in runs):+.1%}", drift(runs))
            for (sample, stage), runs in by_stage.items()]


def drift(runs: list[Row]) -> str:
    """How much slower the slowest round measured than the fastest, among the rounds whose
    plan chose the most common micro-batch size."""
    common = statistics.mode(r.micro_batch for r in runs)
    measured = [r.measured_s for r in runs if r.micro_batch == common]
    return f"{max(measured) / min(measured) - 1:.0%} (m {common}, {len(measured)} rounds)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for sample in sorted(SAMPLES.glob("*.py")):
                rows += measure(sample, args, Path(tmp))
            print(f"round {round_ + 1} of {args.rounds} done", file=sys.stderr)
    print(tabulate([(r.sample, r.stage, r.micro_batch, f"{r.predicted_s * 1e3:.2f}",
                     f"{r.measured_s * 1e3:.2f}", f"{r.error:+.1%}") for r in rows],
                   ("sample", "stage", "micro-batch", "predicted ms", "measured ms", "error"),
                   tablefmt="github"))
    print()
    print(tabulate(summary(rows), ("sample", "stage", "error per round", "median error",
                                   "measured drift"), tablefmt="github"))


if __name__ == "__main__":
    main()
