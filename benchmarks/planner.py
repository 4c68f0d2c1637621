"""The planner over a model zoo: pipec's plan against the baselines, predicted by the same cost
model, the largest trainable batch, and the planning time; then LLaMA-shaped models with AdamW
and bf16, the levers pipec chose (sharding, recomputation) against its own plan without them
(--fsdp off --recompute none), and the predicted MFU.

    python benchmarks/planner.py [--levers-only]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import Counter
from pathlib import Path

from tabulate import tabulate

from pipec.driver import CompileOptions, analyze
from pipec.errors import InfeasibleError
from pipec.planning import planner
from pipec.planning.planner import Plan

ZOO = Path(__file__).resolve().parent / "zoo"
SAMPLES = Path(__file__).resolve().parent.parent / "samples"

# (model file, devices, nodes, preset or device list, global batch)
ENTRIES = (
    (ZOO / "resnet50.py", 4, 1, "v100-16g", 256),
    (ZOO / "resnet152.py", 4, 1, "v100-16g", 256),
    (ZOO / "vgg16.py", 4, 1, "v100-16g", 256),
    (ZOO / "vit_b16.py", 4, 1, "v100-16g", 256),
    (ZOO / "gpt2_medium.py", 8, 1, "v100-16g", 64),
    (ZOO / "bert_large.py", 8, 1, "v100-16g", 64),
    (ZOO / "gpt2_xl.py", 8, 1, "v100-32g", 32),
    (ZOO / "gpt2_xl.py", 64, 8, "a100-80g", 512),
    (ZOO / "gpt2_xl.py", 4, 1, "a100-80g:2,v100-32g:2", 32),
    (SAMPLES / "resnet.py", 4, 1, "cpu", 64),
    (SAMPLES / "gpt.py", 4, 1, "cpu", 64),
)


# LLaMA-2 shapes, AdamW, bf16: (model file, devices, nodes, preset, global batch). The 70B
# model also at LLaMA-2's own batch, 4M tokens (1,024 sequences of 4,096).
LEVERS = (
    (ZOO / "llama2_7b.py", 8, 1, "a100-80g", 64),
    (ZOO / "llama2_13b.py", 16, 2, "a100-80g", 64),
    (ZOO / "llama2_70b.py", 32, 4, "a100-80g", 64),
    (ZOO / "llama2_70b.py", 32, 4, "a100-80g", 1024),
)
A100_BF16_FLOPS = 312e12


def plan_entry(model: Path, gpus: int, nodes: int, hardware: str, batch: int, schedule: str,
               out: Path, **options: str) -> tuple[Plan, float]:
    """The plan and the time of the plan pass alone (compile also traces and annotates, a few
    seconds for the largest models, and writes the files)."""
    analyzed = analyze(CompileOptions(model=model, out=out, gpus=gpus, nodes=nodes,
                                      batch_size=batch, hardware=hardware, schedule=schedule,
                                      measure="off", **options))  # type: ignore[arg-type]
    started = time.perf_counter()
    chosen = planner.plan(analyzed.graph, analyzed.request)
    return chosen, time.perf_counter() - started


def ratio(plan: Plan, name: str) -> str:
    baseline = next(b for b in plan.baselines if b.strategy == name)
    return (f"{plan.samples_per_s / baseline.samples_per_s:.2f}" if baseline.feasible
            else "does not fit")


def best_baseline(plan: Plan) -> str:
    feasible = [b for b in plan.baselines if b.feasible]
    if not feasible:
        return "none fits"
    best = max(feasible, key=lambda b: b.samples_per_s)
    return f"{best.strategy} {plan.samples_per_s / best.samples_per_s:.2f}"


def max_batch(plan: Plan) -> str:
    pipec, conventional = plan.max_batch[0], plan.max_batch[-1]
    mine = f"≥ {pipec.batch:,}" if pipec.capped else f"{pipec.batch:,}"
    if not conventional.batch:
        return f"{mine} (conventional: none)"
    factor = pipec.batch / conventional.batch
    return f"{mine} vs {conventional.batch:,} ({'≥ ' if pipec.capped else ''}{factor:.2f}×)"


def levers(plan: Plan) -> str:
    """The levers a plan uses: its sharding and its stages' recomputation."""
    counts = Counter(s.recompute for s in plan.stages)
    recompute = ", ".join(f"{counts[m]} {m}" for m in ("full", "selective") if counts[m])
    used = [f"FSDP {plan.fsdp}" if plan.fsdp != "off" else "",
            f"recompute: {recompute}" if recompute else ""]
    return "; ".join(u for u in used if u) or "none"


def mfu(plan: Plan, parameters: int, tokens: int) -> float:
    """Model FLOP utilization: 6 · parameters · tokens per second over the devices' bf16
    peak (the a100-80g preset's 312 TFLOP/s)."""
    return 6 * parameters * tokens * plan.samples_per_s / (plan.request.gpus * A100_BF16_FLOPS)


def lever_rows(tmp: Path) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for model, gpus, nodes, hardware, batch in LEVERS:
        options = {"optimizer": "adamw", "precision": "bf16"}
        plan, seconds = plan_entry(model, gpus, nodes, hardware, batch, "auto", tmp / "l",
                                   **options)
        parameters = sum(s.params for s in plan.stages)
        context = 4096
        try:
            bare, _ = plan_entry(model, gpus, nodes, hardware, batch, "auto", tmp / "b",
                                 fsdp="off", recompute="none", **options)
            without = f"{bare.samples_per_s:.2f} ({mfu(bare, parameters, context):.1%} MFU)"
        except InfeasibleError:
            without = "does not fit"
        rows.append((model.name, f"{gpus} × {hardware} on {nodes} node(s), B {batch}",
                     f"{plan.pp}×{plan.dp} m {plan.micro_batch} {plan.schedule}", levers(plan),
                     f"{plan.samples_per_s:.2f}", f"{mfu(plan, parameters, context):.1%}",
                     without, f"{seconds:.1f}"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levers-only", action="store_true", help="only the LLaMA table")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if not args.levers_only:
            zoo_table(Path(tmp))
            print()
        print(tabulate(lever_rows(Path(tmp)),
                       ("model", "devices", "pipec plan (pp×dp)", "levers chosen", "samples/s",
                        "predicted MFU", "without levers (samples/s)", "plan s"),
                       tablefmt="github"))


def zoo_table(tmp: Path) -> None:
    rows = []
    for model, gpus, nodes, hardware, batch in ENTRIES:
        plan, seconds = plan_entry(model, gpus, nodes, hardware, batch, "auto", tmp / "o")
        try:
            gpipe_batch = max_batch(plan_entry(model, gpus, nodes, hardware, batch, "gpipe",
                                               tmp / "g")[0])
        except InfeasibleError:
            gpipe_batch = f"GPipe does not fit B {batch}"
        where = f"{gpus} × {hardware}" + (f" on {nodes} nodes" if nodes > 1 else "")
        virtual = f" v {plan.virtual_stages}" if plan.virtual_stages > 1 else ""
        rows.append((model.name, f"{where}, B {batch}",
                     f"{plan.pp}×{plan.dp} m {plan.micro_batch} {plan.schedule}{virtual}",
                     f"{plan.samples_per_s:,.1f}", best_baseline(plan),
                     ratio(plan, "conventional"), max_batch(plan), gpipe_batch,
                     f"{seconds:.1f}"))
    print(tabulate(rows, ("model", "devices", "pipec plan (pp×dp)", "samples/s",
                          "best baseline (pipec ÷)", "÷ conventional", "max batch",
                          "max batch, GPipe only", "plan s"), tablefmt="github"))


if __name__ == "__main__":
    main()
