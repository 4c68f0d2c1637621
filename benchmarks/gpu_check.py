"""The device check: the emitted script's CUDA and NCCL path on one GPU, phase by phase, each with
its own time limit, written to OUT/summary.json and OUT/<phase>.log.

    python benchmarks/gpu_check.py --out OUT [--phase NAME ...] [--steps 20]
    python benchmarks/gpu_check.py --out OUT --dry-run   # the same commands on a CPU: gloo,
                                                         # small shapes (minutes)

Phases (each stands alone: a failure or a time-out is recorded and the next one runs):

- ``versions``: torch, CUDA, NCCL, the device, pipec.
- ``two_ranks``: two ranks on one device. NCCL refuses two ranks on one GPU of one host; with a
  different ``NCCL_HOSTID`` per rank it treats them as two hosts: this phase says whether that
  works (all-reduce, send and receive), which the multi-rank phases below rely on.
- ``runtime_probe``: the probe `pipec compile` runs where it plans 2 GPUs or more of this
  machine (links, all-reduce, the pipelining runtime's time per action and per post), on 2 ranks
  of this one GPU, beside the preset's figures.
- ``communicators``: the memory a process holds outside the allocator: the CUDA context, and
  each further communicator (one per process group a rank uses).
- ``measured``: ``pipec compile --measure auto`` on the device: the model timed here, the plan
  from those times.
- ``losses``: the GPT sample trained by pp 2 (1F1B; ZB-V; 1F1B recomputing), dp 2 (DDP; FSDP
  zero2) and a run resumed on another plan, against one rank: the largest relative difference
  of their losses (target 1e-4 in fp32).
- ``memory``: predicted peak against ``max_memory_allocated`` and ``max_memory_reserved`` per
  rank (``--metrics``), for the samples and the long-sequence LM, fp32 and bf16 (target ±10 %).
- ``step_time``: measured samples/s of runs without ``--metrics`` against the measured-by-default
  plan's prediction, the samples and a ~1B-parameter decoder in bf16 (target ±20 %).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PIPEC = [sys.executable, "-m", "pipec"]
STEP = re.compile(r"^step (\d+) loss (\S+)", re.MULTILINE)
DONE = re.compile(r"^done: \d+ steps, ([\d.,]+) samples/s", re.MULTILINE)


@dataclass
class Check:
    """Where a check runs and what it has found so far."""

    out: Path
    work: Path
    dry_run: bool
    steps: int
    timeout_s: float
    log: Any = None
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def hardware(self) -> str:
        """The preset of this machine's device: $HARDWARE, else the GPU's by name."""
        if self.dry_run:
            return "cpu"
        return os.environ.get("HARDWARE") or local_preset()

    def run(self, command: list[str], cwd: Path | None = None,
            env: dict[str, str] | None = None) -> str:
        """Run one command of the phase, its output to the phase's log; its standard output,
        or CalledProcessError / TimeoutExpired (the phase then fails or times out)."""
        self.log.write(f"$ {' '.join(command)}\n")
        self.log.flush()
        result = subprocess.run(command, cwd=cwd or ROOT, capture_output=True, text=True,
                                timeout=self.timeout_s, check=False,
                                env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        self.log.write(result.stdout + result.stderr)
        if result.returncode:
            raise subprocess.CalledProcessError(result.returncode, command, result.stdout,
                                                result.stderr)
        return result.stdout

    def compile(self, name: str, model: str, *options: str) -> Path:
        out = self.work / name
        self.run([*PIPEC, "compile", model, "--hardware", self.hardware, "-o", str(out),
                  "--force", *options])
        return out

    def train(self, out: Path, processes: int, *options: str) -> str:
        """train.py on `processes` ranks of this one device (a different NCCL host id each)."""
        wrapper = out / "rank.sh"
        wrapper.write_text('#!/bin/sh\nNCCL_HOSTID="gpu-check-$LOCAL_RANK" exec '
                           f'"{sys.executable}" train.py "$@"\n')
        wrapper.chmod(0o755)
        return self.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                         "--nproc_per_node", str(processes), "--no-python", str(wrapper),
                         "--steps", str(self.steps), *options], cwd=out)


def local_preset() -> str:
    """The preset whose name the visible GPU's bears (h200, h100-80g, a100-80g …)."""
    import torch

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    for token, preset in (("H200", "h200"), ("H100", "h100-80g"), ("A100", "a100-80g")):
        if token in name:
            return preset
    raise RuntimeError(f"no preset for the device {name!r}: set HARDWARE to one")


def versions(check: Check) -> None:
    code = ("import json, torch, pipec; cuda = torch.cuda.is_available(); print(json.dumps("
            "{'torch': torch.__version__, 'cuda': torch.version.cuda, 'nccl': "
            "'.'.join(map(str, torch.cuda.nccl.version())) if cuda else None, 'device': "
            "torch.cuda.get_device_name(0) if cuda else 'cpu', 'pipec': pipec.__version__}))")
    check.figures.update(json.loads(check.run([sys.executable, "-c", code])))


TWO_RANKS = """
import os, torch, torch.distributed as dist
cuda = torch.cuda.is_available()
device = torch.device("cuda", 0) if cuda else torch.device("cpu")
dist.init_process_group("nccl" if cuda else "gloo", **({"device_id": device} if cuda else {}))
rank = dist.get_rank()
x = torch.full((1024,), float(rank + 1), device=device)
dist.all_reduce(x)
assert float(x[0]) == 3.0, float(x[0])
if rank == 0:
    dist.send(torch.arange(8.0, device=device), dst=1)
else:
    y = torch.empty(8, device=device)
    dist.recv(y, src=0)
    assert y.tolist() == list(range(8)), y
if cuda:
    torch.cuda.synchronize()
print("rank", rank, "ok")
dist.destroy_process_group()
"""


def two_ranks(check: Check) -> None:
    probe = check.work / "two_ranks"
    probe.mkdir(exist_ok=True)
    (probe / "train.py").write_text(TWO_RANKS)  # takes no arguments: ignores --steps
    check.figures["ranks_ok"] = check.train(probe, 2).count(" ok")


RUNTIME_PROBE = """
import json, sys, torch
from dataclasses import asdict
from pipec.calibration.gpu_probe import probe_gpu_runtime
from pipec.calibration.runtime_fit import runtime_action_fit
from pipec.cost.hardware import load_hardware
figures = probe_gpu_runtime(2, "cuda" if torch.cuda.is_available() else "cpu")
preset = load_hardware(sys.argv[1])
action, post = runtime_action_fit(figures)
print(json.dumps({"measured": {**asdict(figures), "fitted_action_s": action, "fitted_post_s": post},
                  "preset": {"intra_node_latency_s": preset.intra_node_latency_s,
                             "intra_node_bandwidth": preset.intra_node_bandwidth,
                             "allreduce_bandwidth": preset.allreduce_bandwidth}}))
"""


def runtime_probe(check: Check) -> None:
    """The training runtime's probe that `pipec compile` runs on a machine of 2 GPUs or more
    (pipec.calibration.gpu_probe), here on 2 ranks of one GPU: links, all-reduce, the
    runtime's time per action and post, beside the preset's."""
    printed = check.run([sys.executable, "-c", RUNTIME_PROBE, check.hardware])
    check.figures.update(json.loads(printed.strip().splitlines()[-1]))


COMMUNICATORS = """
import json, os, resource, torch, torch.distributed as dist
cuda = torch.cuda.is_available()
device = torch.device("cuda", 0) if cuda else torch.device("cpu")


def used_mib():
    if cuda:  # the device's memory outside PyTorch's allocator
        free, total = torch.cuda.mem_get_info()
        return (total - free - torch.cuda.memory_reserved()) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


if cuda:
    torch.zeros(1, device=device)
figures = {"before_any_mib": used_mib()}
dist.init_process_group("nccl" if cuda else "gloo", **({"device_id": device} if cuda else {}))
groups = [None] + [dist.new_group([0, 1]) for _ in range(3)]
for k, group in enumerate(groups):
    dist.all_reduce(torch.ones(1, device=device), group=group)
    if cuda:
        torch.cuda.synchronize()
    figures[f"after_{k + 1}_communicators_mib"] = used_mib()
if dist.get_rank() == 0:
    print(json.dumps(figures))
dist.destroy_process_group()
"""


def communicators(check: Check) -> None:
    """What a process holds outside the allocator: the CUDA context, then each communicator
    (a rank holds one per process group it uses: pp, dp, tied weights, p2p pairs)."""
    probe = check.work / "communicators"
    probe.mkdir(exist_ok=True)
    (probe / "train.py").write_text(COMMUNICATORS)
    printed = check.train(probe, 2)
    figures = json.loads(printed.strip().splitlines()[-1])
    steps = [figures[f"after_{k}_communicators_mib"] for k in range(1, 5)]
    check.figures.update({name: round(value, 1) for name, value in figures.items()},
                         each_further_communicator_mib=round((steps[-1] - steps[0]) / 3, 1))


def measured(check: Check) -> None:
    started = time.perf_counter()
    out = check.compile("measured", "samples/gpt.py", "--gpus", "1", "--measure", "auto",
                        "--batch-size", "16" if check.dry_run else "64")
    plan = json.loads((out / "plan.json").read_text())
    check.figures.update(compile_s=round(time.perf_counter() - started, 1),
                         measured_on=plan["calibration"],
                         node_times_measured=plan["calibration_node_times"],
                         predicted_samples_per_s=plan["predicted"]["samples_per_s"])
    if not plan["calibration_node_times"]:
        raise RuntimeError("the plan did not use node times measured on this device")


LOSS_PLANS = {
    "pp2 1f1b": ("--gpus", "2", "--pp", "2", "--schedule", "1f1b"),
    "pp2 zbv": ("--gpus", "2", "--pp", "2", "--schedule", "zbv"),
    "pp2 1f1b recompute": ("--gpus", "2", "--pp", "2", "--schedule", "1f1b", "--recompute",
                           "full"),
    "dp2 ddp": ("--gpus", "2", "--pp", "1", "--fsdp", "off"),
    "dp2 fsdp": ("--gpus", "2", "--pp", "1", "--fsdp", "zero2"),
}


def losses(check: Check) -> None:
    batch = ("--batch-size", "8" if check.dry_run else "32", "--measure", "off")
    one = check.compile("losses-one", "samples/gpt.py", "--gpus", "1", *batch)
    reference = losses_of(check.train(one, 1))
    differences = {}
    for name, options in LOSS_PLANS.items():
        out = check.compile("losses-" + name.replace(" ", "-"), "samples/gpt.py", *options,
                            *batch)
        differences[name] = largest_difference(losses_of(check.train(out, 2)), reference)
    half = str(check.steps // 2)
    pp2 = check.work / "losses-pp2-1f1b"
    checkpoints = str(check.work / "losses-checkpoints")
    check.train(pp2, 2, "--checkpoint-dir", checkpoints, "--steps", half)
    resumed = losses_of(check.train(one, 1, "--checkpoint-dir", checkpoints, "--resume"))
    differences["resumed on 1 rank"] = largest_difference(resumed, reference[int(half):])
    check.figures["largest_relative_difference"] = differences
    check.figures["within_1e-4"] = all(d <= 1e-4 for d in differences.values())


MEMORY_PLANS = {
    "gpt fp32": ("samples/gpt.py", "64", ()),
    "gpt bf16": ("samples/gpt.py", "64", ("--precision", "bf16")),
    "resnet": ("samples/resnet.py", "64", ()),
    "long-lm fp32": ("benchmarks/models/long_lm.py", "16", ("--micro-batch", "2")),
    "long-lm bf16": ("benchmarks/models/long_lm.py", "16", ("--micro-batch", "2", "--precision",
                                                            "bf16")),
}


def memory(check: Check) -> None:
    figures = {}
    for name, (model, batch, options) in MEMORY_PLANS.items():
        if check.dry_run:
            batch = "4"
        out = check.compile("memory-" + name.replace(" ", "-"), model, "--gpus", "1",
                            "--batch-size", batch, "--measure", "off", *options)
        check.train(out, 1, "--metrics", "metrics.json")
        predicted = max(json.loads((out / "plan.json").read_text())["predicted"]
                        ["peak_memory_bytes"])
        ranks = json.loads((out / "metrics.json").read_text())["ranks"]
        allocated = max(r["peak_memory_bytes"] for r in ranks)
        reserved = max(r.get("peak_reserved_bytes", allocated) for r in ranks)
        figures[name] = {"predicted_mib": mib(predicted), "allocated_mib": mib(allocated),
                         "reserved_mib": mib(reserved),
                         "error": round(allocated / predicted - 1, 4)}
    check.figures["memory"] = figures


STEP_PLANS = {
    "gpt": ("samples/gpt.py", "64", ()),
    "resnet": ("samples/resnet.py", "64", ()),
    "decoder 1B bf16": ("benchmarks/models/wide_decoder.py", "8", ("--precision", "bf16")),
}


def step_time(check: Check) -> None:
    figures = {}
    for name, (model, batch, options) in STEP_PLANS.items():
        if check.dry_run and "1B" in name:
            continue  # a billion parameters do not train on the host in minutes
        batch = "16" if check.dry_run else batch
        out = check.compile("steps-" + name.replace(" ", "-"), model, "--gpus", "1",
                            "--batch-size", batch, "--measure", "auto", *options)
        predicted = json.loads((out / "plan.json").read_text())["predicted"]["samples_per_s"]
        found = DONE.search(check.train(out, 1))
        if found is None:
            raise RuntimeError(f"{name}: no summary line")
        samples = float(found.group(1).replace(",", ""))
        figures[name] = {"predicted_samples_per_s": round(predicted, 1),
                         "measured_samples_per_s": samples,
                         "measured_over_predicted": round(predicted / samples, 3)}
    check.figures["step_time"] = figures


PHASES: dict[str, Callable[[Check], None]] = {
    "versions": versions, "two_ranks": two_ranks, "runtime_probe": runtime_probe,
    "communicators": communicators,
    "measured": measured, "losses": losses,
    "memory": memory, "step_time": step_time}


def losses_of(printed: str) -> list[float]:
    return [float(v) for _, v in STEP.findall(printed)]


def largest_difference(losses: list[float], reference: list[float]) -> float:
    if not losses or len(losses) > len(reference):
        raise RuntimeError(f"{len(losses)} losses against {len(reference)}")
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=False))


def mib(count: float) -> float:
    return round(count / 2**20, 1)


def run_phase(check: Check, name: str) -> dict[str, Any]:
    """One phase: passed, failed (the error's last line) or timed out, with its figures."""
    check.figures = {}
    started = time.perf_counter()
    with (check.out / f"{name}.log").open("w") as check.log:
        try:
            PHASES[name](check)
            status, error = "passed", None
        except subprocess.TimeoutExpired as exc:
            status, error = "timed out", f"{' '.join(map(str, exc.cmd))} after {exc.timeout} s"
        except Exception as exc:  # a phase stands alone: record it, go on
            status, error = "failed", f"{type(exc).__name__}: {str(exc).strip()[-500:]}"
    result = {"status": status, "seconds": round(time.perf_counter() - started, 1),
              "figures": check.figures, "log": f"{name}.log"}
    if error:
        result["error"] = error
    print(f"gpu_check: {name}: {status} in {result['seconds']} s", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="summary.json and logs here")
    parser.add_argument("--phase", nargs="+", choices=PHASES, default=list(PHASES))
    parser.add_argument("--dry-run", action="store_true",
                        help="on a CPU: gloo, the cpu preset, small batches")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (20; 6 dry)")
    parser.add_argument("--phase-timeout", type=float, default=240,
                        help="seconds any one command of a phase may run (240)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    steps = args.steps or (6 if args.dry_run else 20)
    with tempfile.TemporaryDirectory() as work:
        check = Check(args.out, Path(work), args.dry_run, steps, args.phase_timeout)
        summary = {"dry_run": args.dry_run, "hardware": check.hardware, "steps": steps,
                   "phases": {name: run_phase(check, name) for name in args.phase}}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    failed = [n for n, p in summary["phases"].items() if p["status"] != "passed"]
    print(f"gpu_check: {len(summary['phases']) - len(failed)} of {len(summary['phases'])} "
          f"phases passed{': not ' + ', '.join(failed) if failed else ''}; {args.out}/summary.json")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
