"""Measured, not only predicted: pipec's partition against the uniform and parameter baselines,
run for real on 2 CPU processes.

Calibrates the CPU (`pipec profile`), compiles samples/imbalanced.py as a 2-device pipeline with
`--strategy pipec`, `uniform` and `parameters`, runs each emitted train.py under torchrun with 2
processes, and prints the measured samples/s (median over rounds of the median step after
warm-up) and pipec's ratio to each baseline. Two settings:

- "same m": every strategy with micro-batch --micro-batch and 1F1B, so only the stage boundaries
  differ;
- "own best": each strategy with the micro-batch and schedule its own search predicts fastest.

    python benchmarks/measured_gain.py [--steps 20] [--rounds 2] [--batch-size 128]
                                       [--micro-batch 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from commands import PIPEC, ROOT, TORCHRUN, run
from tabulate import tabulate

MODEL = ROOT / "samples" / "imbalanced.py"
STRATEGIES = ("pipec", "uniform", "parameters")
WARMUP_STEPS = 5


def compile_all(work: Path, batch_size: int, micro_batch: int) -> dict[tuple[str, str], Path]:
    calibration = work / "calib.json"
    run([*PIPEC, "profile", str(MODEL), "--batch-size", str(batch_size), "-o", str(calibration)])
    settings = {"same m": ["--micro-batch", str(micro_batch), "--schedule", "1f1b"],
                "own best": []}
    outs = {}
    for setting, fixed in settings.items():
        for strategy in STRATEGIES:
            out = outs[(setting, strategy)] = work / f"{setting.replace(' ', '_')}_{strategy}"
            run([*PIPEC, "compile", str(MODEL), "--gpus", "2", "--pp", "2", "--batch-size",
                 str(batch_size), "--hardware", "cpu", "--calibration", str(calibration),
                 "--strategy", strategy, *fixed, "-o", str(out)])
    return outs


def measure(out: Path, steps: int) -> float:
    """Median samples/s over the steps after warm-up."""
    text = run([str(TORCHRUN), "--standalone", "--nproc_per_node", "2", "train.py",
                "--steps", str(steps)], cwd=out)
    rates = [float(line.split()[-1]) for line in text.splitlines() if line.startswith("step ")]
    return statistics.median(rates[WARMUP_STEPS:])


def describe(out: Path) -> tuple[str, str, float]:
    plan = json.loads((out / "plan.json").read_text())
    nodes = [stage["nodes"] for stage in plan["stages"]]
    schedule = plan["schedule"] + (f" v={plan['virtual_stages']}"
                                   if plan["virtual_stages"] > 1 else "")
    return (f"m {plan['micro_batch']} {schedule}", " | ".join(f"{a}–{b}" for a, b in nodes),
            plan["predicted"]["samples_per_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        outs = compile_all(Path(tmp), args.batch_size, args.micro_batch)
        measured: dict[tuple[str, str], list[float]] = {key: [] for key in outs}
        for round_ in range(args.rounds):
            # Alternate the order each round, so that drift in the machine's speed is shared.
            order = list(outs) if round_ % 2 == 0 else list(reversed(outs))
            for key in order:
                measured[key].append(measure(outs[key], args.steps))
                print(f"round {round_ + 1}: {key[0]}, {key[1]}: {measured[key][-1]:.1f} "
                      "samples/s", flush=True)
        rows = [row(key, outs[key], measured) for key in outs]
    print(tabulate(rows, ("setting", "strategy", "plan", "stage nodes", "predicted samples/s",
                          "measured samples/s", "pipec ÷ strategy"), tablefmt="github"))
    for setting in ("same m", "own best"):
        pipec = statistics.median(measured[(setting, "pipec")])
        faster = all(pipec > statistics.median(measured[(setting, s)]) for s in STRATEGIES[1:])
        print(f"{setting}: pipec measured faster than both baselines: {'yes' if faster else 'no'}")


def row(key: tuple[str, str], out: Path, measured: dict[tuple[str, str], list[float]]
        ) -> tuple[str, ...]:
    plan, nodes, predicted = describe(out)
    rate = statistics.median(measured[key])
    pipec = statistics.median(measured[(key[0], "pipec")])
    return (*key, plan, nodes, f"{predicted:,.1f}", f"{rate:,.1f}", f"{pipec / rate:.2f}")


if __name__ == "__main__":
    main()
