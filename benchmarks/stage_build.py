"""Each rank materializes only its own stages: a 0.94 B-parameter decoder (3.5 GiB in fp32) on
4 CPU processes, 4 pipeline stages.

Compiles benchmarks/models/wide_decoder.py for `--pp 4`, runs the emitted train.py under
torchrun with `--metrics` (the seeded build: local rank 0 builds the whole model once, in a
child process, and each rank reads its stages' weights), then, with `--init-from`, from the
model that run saved with `--save-model`. Prints, per rank, its device's planned peak, the
measured peak above the process's baseline, and the other stages' weights (what a rank that
built the whole model would hold on top); and each run's wall time.

    python benchmarks/stage_build.py [--steps 2]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from commands import PIPEC, ROOT, TORCHRUN, run
from tabulate import tabulate

MODEL = ROOT / "benchmarks" / "models" / "wide_decoder.py"
GIB = 2**30


def compile_plan(out: Path) -> dict:
    run([*PIPEC, "compile", str(MODEL), "--gpus", "4", "--pp", "4", "--batch-size", "8",
         "--hardware", "cpu", "--measure", "off", "-o", str(out)])
    return json.loads((out / "plan.json").read_text())


def train(out: Path, steps: int, *options: str) -> tuple[list[dict], float]:
    """Each rank's measured figures, and the run's wall time."""
    started = time.perf_counter()
    run([str(TORCHRUN), "--standalone", "--nproc_per_node", "4", "train.py", "--steps",
         str(steps), "--metrics", "metrics.json", *options], cwd=out)
    seconds = time.perf_counter() - started
    return json.loads((out / "metrics.json").read_text())["ranks"], seconds


def rows(ranks: list[dict], plan: dict) -> list[list[object]]:
    """Per rank: planned and measured peak, and the other stages' weights, which a rank that
    built the whole model would hold on top of its own."""
    planned = plan["predicted"]["peak_memory_bytes"]
    params = {d: sum(s["params"] for s in plan["stages"] if s["device"] == d)
              for d in range(plan["pp"])}
    whole = sum(params.values())
    return [[r["rank"], f"{planned[r['device']] / GIB:.2f}",
             f"{r['peak_memory_bytes'] / GIB:.2f}",
             f"{r['peak_memory_bytes'] / planned[r['device']] - 1:+.1%}",
             f"{(whole - params[r['device']]) * 4 / GIB:.2f}"]
            for r in sorted(ranks, key=lambda r: r["rank"])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "out"
        plan = compile_plan(out)
        params = sum(stage["params"] for stage in plan["stages"])
        print(f"model: {params / 1e9:.2f} B parameters, {params * 4 / GIB:.2f} GiB in fp32; "
              f"plan: {len(plan['stages'])} stages on {plan['pp']} processes, micro-batch "
              f"{plan['micro_batch']}, {plan['schedule']}, {plan['optimizer']}")
        saved = Path(scratch) / "saved.safetensors"
        headers = ["rank", "planned GiB", "measured GiB", "error",
                   "other stages' weights GiB"]
        for name, options in (("seeded build", ("--save-model", str(saved))),
                              ("--init-from", ("--init-from", str(saved)))):
            ranks, seconds = train(out, args.steps, *options)
            print(f"\n{name}: {args.steps} steps in {seconds:.1f} s (start-up included)")
            print(tabulate(rows(ranks, plan), headers=headers, tablefmt="github"))


if __name__ == "__main__":
    main()
