"""The training runtime's own time on this machine's CPU processes: per forward or backward
action of a stage, and per optimizer step, beyond kernels and links (`Device.action_overhead_s`,
`Device.step_overhead_s`).

    python benchmarks/runtime_overhead.py [--steps 30]

A 5-node model too small to compute anything is compiled for 2 pipeline stages (1F1B,
micro-batch 1) at 4, 16 and 32 micro-batches and trained with `--metrics`: the first stage's
timed forward and backward calls (which hold no loss) divided by its actions give the cost per
action; what the step takes beyond the schedule simulated with that cost and the measured links
is fitted as a cost per step plus a cost per micro-batch (the latter is not in the model). Then
the GPT sample on 2 stages is predicted without and with the first two, and measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
from commands import PIPEC, ROOT, TORCHRUN, run

from pipec.hardware import PRESETS, Device

TINY = '''import torch
from torch import nn


def build_model():
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def sample_batch(batch_size):
    return torch.randn(batch_size, 4), torch.randint(0, 2, (batch_size,))
'''


def trained(model: Path, device: Device, work: Path, name: str, steps: int,
            *options: str) -> tuple[dict, dict]:
    """(plan.json, metrics.json) of ``model`` compiled for 2 CPU processes and trained."""
    hardware = work / f"{name}.json"
    hardware.write_text(json.dumps(asdict(device)))
    out = work / name
    run([*PIPEC, "compile", str(model), "--gpus", "2", "--pp", "2", "--hardware",
         str(hardware), *options, "-o", str(out)])
    run([str(TORCHRUN), "--standalone", "--nproc_per_node", "2", "train.py", "--steps",
         str(steps), "--metrics", "metrics.json"], cwd=out)
    return (json.loads((out / "plan.json").read_text()),
            json.loads((out / "metrics.json").read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    bare = replace(PRESETS["cpu"], name="cpu-bare", action_overhead_s=0.0, step_overhead_s=0.0)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tiny = work / "tiny.py"
        tiny.write_text(TINY)
        counts = (4, 16, 32)
        per_action = []
        for m in counts:
            _, metrics = trained(tiny, bare, work, f"actions{m}", args.steps, "--batch-size",
                                 str(m), "--micro-batch", "1", "--schedule", "1f1b")
            first = next(r for r in metrics["ranks"] if r["device"] == 0)
            per_action.append(first["busy_s"] / (2 * m))
        action = statistics.median(per_action)
        with_actions = replace(bare, name="cpu-actions", action_overhead_s=action)
        beyond = []
        for m in counts:
            plan, metrics = trained(tiny, with_actions, work, f"steps{m}", args.steps,
                                    "--batch-size", str(m), "--micro-batch", "1",
                                    "--schedule", "1f1b")
            beyond.append(metrics["step_s"] - plan["predicted"]["iteration_s"])
        # What the step takes beyond the simulated schedule, as a + b · micro-batches.
        per_micro_batch, per_step = np.polyfit(counts, beyond, 1)
        print("micro-batches: " + ", ".join(map(str, counts)))
        print("per action (ms): " + ", ".join(f"{a * 1e3:.3f}" for a in per_action)
              + f"; median {action * 1e3:.3f}")
        print("beyond the simulated schedule (ms): "
              + ", ".join(f"{b * 1e3:.2f}" for b in beyond)
              + f"; fitted {per_step * 1e3:.2f} per step + {per_micro_batch * 1e3:.3f} per "
              "micro-batch")
        measured = replace(bare, name="cpu-measured", action_overhead_s=action,
                           step_overhead_s=max(per_step, 0.0))
        for device in (bare, measured):
            plan, metrics = trained(ROOT / "samples/gpt.py", device, work, device.name,
                                    args.steps, "--batch-size", "32", "--micro-batch", "4",
                                    "--schedule", "1f1b")
            predicted, real = plan["predicted"]["iteration_s"], metrics["step_s"]
            print(f"GPT sample, 2 stages, 1F1B, 8 micro-batches, {device.name}: predicted "
                  f"{predicted * 1e3:.1f} ms, measured {real * 1e3:.1f} ms "
                  f"({real / predicted:.2f}×)")


if __name__ == "__main__":
    main()
