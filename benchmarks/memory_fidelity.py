"""Predicted against measured peak memory, per device, for plans run for real on CPU processes.

Each case compiles a model with `pipec compile --hardware cpu` and fixed choices (pp × dp,
micro-batch, schedule, optimizer), runs the emitted train.py under torchrun for a few steps with
`--metrics` in glibc's heap (PIPEC_ALLOCATOR=glibc), and sets each pipeline device's predicted
peak (plan.json) against its measured peak (the largest over its data-parallel replicas): the
peak resident set size above the process's own baseline, taken before the model is built,
with glibc returning every freed block of a page or more to the OS, so that it follows what is
allocated (see docs/runtime.md). The target is every device within ±15 %. It then runs the
script again as users run it, without `--metrics` and under its own allocator (tcmalloc where
the system has it), and sets the resident peak that run prints (the allocator's free memory
included, as the OS counts it) against the same prediction: within ±20 %.

    python benchmarks/memory_fidelity.py [--steps 3] [--only NAME ...] [--check]

`--check` exits 1 when a device misses either target. `--max-batch` also checks one predicted
maximum batch for real: the long-sequence LM on 2 pipeline devices (GPipe, where every
micro-batch is in flight: under 1F1B only the step's token ids grow with the batch) of a
`--device-mib`-sized device; the largest batch pipec reports is run, its measured peak must stay
within the device, and the next batch must be refused. `--largest-micro-batch` does the same on
one device of `--hardware` (a GPU preset on a GPU machine, the check of benchmarks/gpu_check.sh):
the largest micro-batch of the long-sequence LM that pipec accepts on a `--device-mib` device
is run, and one more sample must be refused.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from commands import PIPEC, ROOT, TORCHRUN, resident_peaks_mib, run
from tabulate import tabulate

from pipec.cost.hardware import PRESETS, load_hardware

TARGET = 0.15
RESIDENT_TARGET = 0.20  # a default run's resident size, heap included
# --metrics in glibc's heap, every block of a page or more mapped apart: what is allocated.
ALLOCATED = {"PIPEC_ALLOCATOR": "glibc"}
MIB = 2**20


@dataclass(frozen=True)
class Case:
    name: str
    model: str  # relative to the repository
    processes: int
    options: tuple[str, ...]  # pipec compile flags beyond --gpus and --hardware
    stresses: str


CASES = (
    Case("gpt 1f1b", "samples/gpt.py", 2,
         ("--pp", "2", "--batch-size", "32", "--micro-batch", "4", "--schedule", "1f1b"),
         "the sample transformer"),
    Case("mlp gpipe", "samples/mlp.py", 2,
         ("--pp", "2", "--batch-size", "64", "--micro-batch", "8", "--schedule", "gpipe"),
         "a model whose runtime outweighs it"),
    Case("resnet 1f1b", "samples/resnet.py", 2,
         ("--pp", "2", "--batch-size", "32", "--micro-batch", "4", "--schedule", "1f1b"),
         "BatchNorm → GroupNorm, residuals"),
    Case("long-lm 1f1b M16", "benchmarks/models/long_lm.py", 2,
         ("--pp", "2", "--batch-size", "16", "--micro-batch", "1", "--schedule", "1f1b"),
         "vocabulary 4096 × sequence 1024: logits, loss, receive buffers × 16"),
    Case("long-lm dp2 adamw", "benchmarks/models/long_lm.py", 2,
         ("--pp", "1", "--batch-size", "8", "--micro-batch", "2", "--optimizer", "adamw"),
         "data-parallel replicas (DDP buckets), AdamW state"),
    Case("long-lm gpipe adamw", "benchmarks/models/long_lm.py", 2,
         ("--pp", "2", "--batch-size", "8", "--micro-batch", "2", "--schedule", "gpipe",
          "--optimizer", "adamw"),
         "every micro-batch in flight, AdamW"),
    Case("unet gpipe", "benchmarks/models/unet.py", 2,
         ("--pp", "2", "--batch-size", "16", "--micro-batch", "4", "--schedule", "gpipe"),
         "large feature maps, skips across the cut, in-place ReLU"),
    Case("gpt interleaved", "samples/gpt.py", 2,
         ("--pp", "2", "--batch-size", "32", "--micro-batch", "4", "--schedule",
          "interleaved", "--virtual-stages", "2"),
         "two stages per device"),
    Case("long-lm 1f1b pp4 M32", "benchmarks/models/long_lm.py", 4,
         ("--pp", "4", "--batch-size", "32", "--micro-batch", "1", "--schedule", "1f1b"),
         "1F1B with many micro-batches on 4 stages"),
    Case("unet pp2×dp2", "benchmarks/models/unet.py", 4,
         ("--pp", "2", "--batch-size", "16", "--micro-batch", "2", "--schedule", "1f1b"),
         "pipeline × data parallelism"),
    Case("resnet gpipe pp4", "samples/resnet.py", 4,
         ("--pp", "4", "--batch-size", "64", "--micro-batch", "8", "--schedule", "gpipe"),
         "4 stages, every micro-batch in flight"),
    Case("gpt bf16 1f1b", "samples/gpt.py", 2,
         ("--pp", "2", "--batch-size", "64", "--micro-batch", "8", "--schedule", "1f1b",
          "--precision", "bf16"),
         "bf16 autocast: bf16 copies of fp32 inputs, fp32 LayerNorm inputs"),
    Case("long-lm bf16 gpipe", "benchmarks/models/long_lm.py", 2,
         ("--pp", "2", "--batch-size", "2", "--micro-batch", "1", "--schedule", "gpipe",
          "--precision", "bf16"),
         "bf16 autocast on large logits: an fp32 loss, bf16 boundaries"),
    Case("resnet dp2 syncbn", "samples/resnet.py", 2,
         ("--pp", "1", "--batch-size", "64", "--micro-batch", "16"),
         "data parallelism: BatchNorm synchronized across replicas, DDP buckets"),
    Case("gpt zbv", "samples/gpt.py", 2,
         ("--pp", "2", "--batch-size", "32", "--micro-batch", "4", "--schedule", "zbv"),
         "zero bubble V: activations kept until the weights' gradient, copies sent"),
    Case("gpt interleaved-zb", "samples/gpt.py", 2,
         ("--pp", "2", "--batch-size", "32", "--micro-batch", "4", "--schedule",
          "interleaved-zb", "--virtual-stages", "2"),
         "interleaved zero bubble"),
    Case("unet interleaved-zb", "benchmarks/models/unet.py", 2,
         ("--pp", "2", "--batch-size", "16", "--micro-batch", "8", "--schedule",
          "interleaved-zb", "--virtual-stages", "2"),
         "interleaved zero bubble on large feature maps and skips"),
    Case("gpt interleaved pp4", "samples/gpt.py", 4,
         ("--pp", "4", "--batch-size", "32", "--micro-batch", "2", "--schedule",
          "interleaved", "--virtual-stages", "2", "--optimizer", "adamw"),
         "8 stages on 4 devices, AdamW"),
    Case("long-lm dp2 adamw zero2", "benchmarks/models/long_lm.py", 2,
         ("--pp", "1", "--batch-size", "8", "--micro-batch", "2", "--optimizer", "adamw",
          "--fsdp", "zero2"),
         "FSDP: AdamW state and master weights sharded, gathered weights and gradients"),
    Case("long-lm pp2×dp2 zero3", "benchmarks/models/long_lm.py", 4,
         ("--pp", "2", "--batch-size", "16", "--micro-batch", "2", "--schedule", "1f1b",
          "--optimizer", "adamw", "--fsdp", "zero3"),
         "FSDP under a pipeline: weights gathered again after each forward"),
    Case("long-lm dp2 adamw block", "benchmarks/models/long_lm.py", 2,
         ("--pp", "1", "--batch-size", "8", "--micro-batch", "2", "--optimizer", "adamw",
          "--fsdp", "block"),
         "FSDP a unit per block: one block's weights and gradients whole at a time"),
    Case("long-lm pp2×dp2 block", "benchmarks/models/long_lm.py", 4,
         ("--pp", "2", "--batch-size", "16", "--micro-batch", "2", "--schedule", "1f1b",
          "--optimizer", "adamw", "--fsdp", "block"),
         "FSDP per block under a pipeline: gradients reduce-scattered every micro-batch"),
    Case("attention selective gpipe", "tests/models/manual_attention.py", 2,
         ("--pp", "2", "--batch-size", "32", "--micro-batch", "4", "--schedule", "gpipe",
          "--recompute", "selective"),
         "selective recomputation: the products' outputs kept, the T × T scores made again"),
    Case("gpt tp2", "samples/gpt.py", 2,
         ("--tp", "2", "--pp", "1", "--batch-size", "64", "--micro-batch", "32"),
         "tensor parallelism: a rank's parts of the linears, whole inputs of the regions"),
    Case("gpt tp2×pp2 adamw", "samples/gpt.py", 4,
         ("--tp", "2", "--pp", "2", "--batch-size", "64", "--micro-batch", "16", "--schedule",
          "1f1b", "--optimizer", "adamw"),
         "tensor × pipeline parallelism, AdamW state of the parts"),
    Case("long-lm tp2 1f1b", "benchmarks/models/long_lm.py", 4,
         ("--tp", "2", "--pp", "2", "--batch-size", "8", "--micro-batch", "1", "--schedule",
          "1f1b"),
         "tensor parallelism on large logits: the head's parts gathered whole"),
    Case("long-lm tp2 1f1b sp", "benchmarks/models/long_lm.py", 4,
         ("--tp", "2", "--pp", "2", "--batch-size", "8", "--micro-batch", "1", "--schedule",
          "1f1b", "--sequence-parallel", "on"),
         "sequence parallelism: norms on half the sequence, half of it sent to the next stage"),
    Case("long-lm tp2×dp2 block", "benchmarks/models/long_lm.py", 4,
         ("--tp", "2", "--pp", "1", "--batch-size", "8", "--micro-batch", "2", "--optimizer",
          "adamw", "--fsdp", "block"),
         "tensor parallelism under FSDP per block: the row-parallel parts stay whole"),
)


def measure(case: Case, work: Path, steps: int) -> list[tuple[str, ...]]:
    """One row per pipeline device: predicted MiB, measured with --metrics and in a default run,
    the errors, the largest terms."""
    out = work / case.name.replace(" ", "_")
    run([*PIPEC, "compile", str(ROOT / case.model), "--gpus", str(case.processes),
         "--hardware", "cpu", *case.options, "-o", str(out)])
    run([str(TORCHRUN), "--standalone", "--nproc_per_node", str(case.processes), "train.py",
         "--steps", str(steps), "--metrics", "metrics.json"], cwd=out,
        environment=ALLOCATED)
    default = run([str(TORCHRUN), "--standalone", "--nproc_per_node", str(case.processes),
                   "train.py", "--steps", str(steps)], cwd=out)
    plan = json.loads((out / "plan.json").read_text())
    metrics = json.loads((out / "metrics.json").read_text())
    resident = [mib * MIB for mib in resident_peaks_mib(default)]
    rows = []
    for device, predicted in enumerate(plan["predicted"]["peak_memory_bytes"]):
        ranks = [r for r in metrics["ranks"] if r["device"] == device]
        measured = max(r["peak_memory_bytes"] for r in ranks)
        held = max(resident[r["rank"]] for r in ranks)
        terms = plan["predicted"]["memory_terms"][device]
        largest = sorted(terms, key=lambda t: -terms[t])[:3]
        rows.append((case.name, str(device), f"{predicted / MIB:.1f}", f"{measured / MIB:.1f}",
                     f"{measured / predicted - 1:+.1%}", f"{held / MIB:.1f}",
                     f"{held / predicted - 1:+.1%}",
                     ", ".join(f"{t} {terms[t] / MIB:.0f}" for t in largest)))
    return rows


def check_max_batch(work: Path, device_mib: int, steps: int) -> None:
    """Compile at the reported maximum batch and run it; the next batch must be refused."""
    model = str(ROOT / "benchmarks/models/long_lm.py")
    device = work / "device.json"
    # The cpu preset, with a smaller memory: what the runtime holds stays as measured here.
    device.write_text(json.dumps({**asdict(PRESETS["cpu"]), "name": f"cpu-{device_mib}m",
                                  "memory_bytes": device_mib * MIB, "process_bytes": 0}))
    fixed = ["--gpus", "2", "--pp", "2", "--schedule", "gpipe", "--hardware", str(device)]
    run([*PIPEC, "compile", model, *fixed, "--batch-size", "4", "-o", str(work / "search")])
    largest = json.loads((work / "search" / "plan.json").read_text())["max_batch"]["pipec"]
    out = work / "largest"
    run([*PIPEC, "compile", model, *fixed, "--batch-size", str(largest), "--micro-batch", "1",
         "-o", str(out)])
    run([str(TORCHRUN), "--standalone", "--nproc_per_node", "2", "train.py", "--steps",
         str(steps), "--metrics", "metrics.json"], cwd=out,
        environment=ALLOCATED)
    plan = json.loads((out / "plan.json").read_text())
    metrics = json.loads((out / "metrics.json").read_text())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    refused = subprocess.run([*PIPEC, "compile", model, *fixed, "--batch-size", str(largest + 2),
                              "--micro-batch", "1", "-o", str(work / "next")], env=env,
                             capture_output=True, text=True, check=False)
    print(f"\nmax batch on 2 × {device_mib} MiB devices (long-lm, pp 2, GPipe): pipec reports "
          f"{largest}; run at {largest}:")
    for rank in sorted(metrics["ranks"], key=lambda r: r["device"]):
        predicted = plan["predicted"]["peak_memory_bytes"][rank["device"]]
        measured = rank["peak_memory_bytes"]
        print(f"  device {rank['device']}: predicted {predicted / MIB:.1f} MiB, measured "
              f"{measured / MIB:.1f} MiB of {device_mib} MiB: "
              f"{'within' if measured <= device_mib * MIB else 'OVER'} the device")
    print(f"  batch {largest + 2}: {'refused' if refused.returncode == 2 else 'NOT refused'} "
          f"({refused.stderr.strip().splitlines()[-1] if refused.stderr.strip() else 'ok'})")


def check_largest_micro_batch(work: Path, hardware: str, device_mib: int, steps: int) -> None:
    """One device of ``hardware`` (a preset or a JSON file) with ``device_mib`` of memory: the
    largest micro-batch pipec accepts (one micro-batch per step) is run; what the process
    holds then (its measured peak, or on a GPU the allocator's reserve, plus the device's
    process_bytes) must stay within the device."""
    base = load_hardware(hardware)
    device = work / "device.json"
    device.write_text(json.dumps({**asdict(base), "name": f"{base.name}-{device_mib}m",
                                  "memory_bytes": device_mib * MIB}))
    model = str(ROOT / "benchmarks/models/long_lm.py")

    def accepted(micro_batch: int) -> bool:
        result = subprocess.run([*PIPEC, "compile", model, "--gpus", "1", "--hardware",
                                 str(device), "--batch-size", str(micro_batch), "--micro-batch",
                                 str(micro_batch), "-o", str(work / f"mb{micro_batch}")],
                                capture_output=True, text=True, check=False)
        if result.returncode not in (0, 2):
            raise SystemExit(f"pipec compile failed:\n{result.stderr}")
        return result.returncode == 0

    low, high = 0, 1  # low is accepted (0: nothing yet), high is the next to try
    while high <= 4096 and accepted(high):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if accepted(middle) else (low, middle)
    if low == 0:
        raise SystemExit(f"not even one sample fits a {device_mib} MiB {base.name}")
    out = work / f"mb{low}"
    run([sys.executable, "train.py", "--steps", str(steps), "--metrics", "metrics.json"],
        cwd=out, environment=ALLOCATED)
    plan = json.loads((out / "plan.json").read_text())
    rank = json.loads((out / "metrics.json").read_text())["ranks"][0]
    predicted, measured = plan["predicted"]["peak_memory_bytes"][0], rank["peak_memory_bytes"]
    held = rank.get("peak_reserved_bytes", measured) + base.process_bytes
    print(f"\nlargest micro-batch on one {device_mib} MiB {base.name} (long-lm): pipec accepts "
          f"{low}, refuses {low + 1}; run at {low}: predicted {predicted / MIB:.1f} MiB, "
          f"measured {measured / MIB:.1f} MiB ({measured / predicted - 1:+.1%}; "
          f"{rank.get('memory_measure')}); held with the process's own "
          f"{held / MIB:.1f} MiB of {device_mib} MiB: "
          f"{'within' if held <= device_mib * MIB else 'OVER'} the device")
    terms = plan["predicted"]["memory_terms"][0]
    print("  predicted terms (MiB): " + ", ".join(f"{t} {v / MIB:.1f}" for t, v in terms.items()))


def main() -> None:
    # Memory depends on no time figure, and every choice is fixed: measuring each model's
    # compute first (`--measure auto`) would only add seconds per case.
    os.environ["PIPEC_MEASURE"] = "off"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--only", nargs="*", default=None, help="case names to run")
    parser.add_argument("--check", action="store_true", help="exit 1 when a device misses a target")
    parser.add_argument("--max-batch", action="store_true",
                        help="also run one predicted maximum batch for real")
    parser.add_argument("--device-mib", type=int, default=512)
    parser.add_argument("--largest-micro-batch", action="store_true",
                        help="run the largest micro-batch accepted on one --hardware device")
    parser.add_argument("--hardware", default="cpu", help="a preset or a JSON file (cpu)")
    args = parser.parse_args()
    cases = [c for c in CASES if args.only is None or c.name in args.only]
    rows: list[tuple[str, ...]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            rows += measure(case, Path(tmp), args.steps)
            print("\n".join(" | ".join(r) for r in rows if r[0] == case.name), flush=True)
    if rows:
        summarize(rows, len(cases), args.check)
    if args.max_batch:
        with tempfile.TemporaryDirectory() as tmp:
            check_max_batch(Path(tmp), args.device_mib, args.steps)
    if args.largest_micro_batch:
        with tempfile.TemporaryDirectory() as tmp:
            check_largest_micro_batch(Path(tmp), args.hardware, args.device_mib, args.steps)


def summarize(rows: list[tuple[str, ...]], cases: int, check: bool) -> None:
    print()
    print(tabulate(rows, ("case", "device", "predicted MiB", "--metrics MiB", "error",
                          "default run MiB", "error", "largest predicted terms (MiB)"),
                   tablefmt="github"))
    measured = [abs(float(r[4].rstrip("%")) / 100) for r in rows]
    resident = [abs(float(r[6].rstrip("%")) / 100) for r in rows]
    missed = sum(e > TARGET for e in measured)
    held = sum(e > RESIDENT_TARGET for e in resident)
    print(f"\n{len(rows)} devices in {cases} cases: --metrics worst error {max(measured):.1%}, "
          f"{missed} outside ±{TARGET:.0%}; default run (resident) worst error "
          f"{max(resident):.1%}, {held} outside ±{RESIDENT_TARGET:.0%}")
    if check and (missed or held):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
