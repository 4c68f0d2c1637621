"""The planner over a model zoo: pipec's plan against the baselines, predicted by the same cost
model, the largest trainable batch, and the planning time.

    python benchmarks/planner.py
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from tabulate import tabulate

from pipec.driver import CompileOptions, compile_model
from pipec.planner import Plan

ZOO = Path(__file__).resolve().parent / "zoo"
SAMPLES = Path(__file__).resolve().parent.parent / "samples"

# (model file, devices, preset, global batch)
ENTRIES = (
    (ZOO / "resnet50.py", 4, "v100-16g", 256),
    (ZOO / "resnet152.py", 4, "v100-16g", 256),
    (ZOO / "vgg16.py", 4, "v100-16g", 256),
    (ZOO / "vit_b16.py", 4, "v100-16g", 256),
    (ZOO / "gpt2_medium.py", 8, "v100-16g", 64),
    (ZOO / "bert_large.py", 8, "v100-16g", 64),
    (ZOO / "gpt2_xl.py", 8, "v100-32g", 32),
    (SAMPLES / "resnet.py", 4, "cpu", 64),
    (SAMPLES / "gpt.py", 4, "cpu", 64),
)


def plan_entry(model: Path, gpus: int, hardware: str, batch: int, schedule: str,
               out: Path) -> tuple[Plan, float]:
    started = time.perf_counter()
    plan, _ = compile_model(CompileOptions(model=model, out=out, gpus=gpus, batch_size=batch,
                                           hardware=hardware, schedule=schedule, force=True))
    return plan, time.perf_counter() - started


def ratio(plan: Plan, name: str) -> str:
    baseline = next(b for b in plan.baselines if b.name == name)
    return (f"{plan.samples_per_s / baseline.samples_per_s:.2f}" if baseline.feasible
            else "does not fit")


def best_baseline(plan: Plan) -> str:
    feasible = [b for b in plan.baselines if b.feasible]
    if not feasible:
        return "none fits"
    best = max(feasible, key=lambda b: b.samples_per_s)
    return f"{best.name} {plan.samples_per_s / best.samples_per_s:.2f}"


def max_batch(plan: Plan) -> str:
    pipec, conventional = plan.max_batch[0], plan.max_batch[-1]
    mine = f"≥ {pipec.batch:,}" if pipec.capped else f"{pipec.batch:,}"
    if not conventional.batch:
        return f"{mine} (conventional: none)"
    factor = pipec.batch / conventional.batch
    return f"{mine} vs {conventional.batch:,} ({'≥ ' if pipec.capped else ''}{factor:.2f}×)"


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model, gpus, hardware, batch in ENTRIES:
            plan, seconds = plan_entry(model, gpus, hardware, batch, "auto", Path(tmp) / "o")
            gpipe, _ = plan_entry(model, gpus, hardware, batch, "gpipe", Path(tmp) / "g")
            rows.append((model.name, f"{gpus} × {hardware}, B {batch}",
                         f"{plan.pp}×{plan.dp} m {plan.micro_batch} {plan.schedule}",
                         f"{plan.samples_per_s:,.1f}", best_baseline(plan),
                         ratio(plan, "conventional"), max_batch(plan), max_batch(gpipe),
                         f"{seconds:.1f}"))
    print(tabulate(rows, ("model", "devices", "pipec plan (pp×dp)", "samples/s",
                          "best baseline (pipec ÷)", "÷ conventional", "max batch",
                          "max batch, GPipe only", "plan s"), tablefmt="github"))


if __name__ == "__main__":
    main()
