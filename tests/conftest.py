"""Shared fixtures: compile a model file, load the emitted modules, run the emitted script."""

from __future__ import annotations

import importlib.util
import json
import os

# One thread per process: several training processes share the machine's cores, and forked
# workers must not inherit a running OpenMP pool.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Plans from the presets: measuring on this machine (--measure auto) is slow and varies between
# runs; the tests of that path turn it on.
os.environ.setdefault("PIPEC_MEASURE", "off")

import re
import runpy
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed.pipelining
import torch.multiprocessing as mp

from pipec.codegen.output_dir import emitted_modules
from pipec.cost.hardware import load_devices
from pipec.cost.model import usable_memory
from pipec.driver import CompileOptions, compile_model
from pipec.planning.planner import Plan

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "samples"
MODELS = Path(__file__).resolve().parent / "models"
STEP_LINE = re.compile(r"^step (\d+) loss (\S+)", re.MULTILINE)


def compile_to(model: Path, out: Path, **options: Any) -> Plan:
    """Compile with the CPU preset and, unless the test says otherwise (pp=None: searched),
    one pipeline stage per device."""
    options.setdefault("hardware", "cpu")
    options.setdefault("measure", "off")
    options.setdefault("pp", options.get("gpus", 1))
    plan, _ = compile_model(CompileOptions(model=model, out=out, **options))
    return plan


def compile_apart(model: Path, out: Path, **options: Any) -> Plan:
    """compile_to in a forked child. On torch's CUDA builds, annotating some exported models
    starts autograd's engine threads (seen on 2.11 with the Hugging Face GPT-2), and a process
    that has started them cannot fork ranks that train: compile those here."""
    with mp.get_context("fork").Pool(1) as pool:
        return pool.apply(compile_to, (model, out), options)


def glibc_environment() -> dict[str, str]:
    """This process's variables for a script run in glibc's heap, one thread per process."""
    return {**{k: v for k, v in os.environ.items() if k != "LD_PRELOAD"},
            "OMP_NUM_THREADS": "1", "PIPEC_ALLOCATOR": "glibc"}


def measured_peaks(out: Path, processes: int = 2) -> list[float]:
    """Each device's measured peak (the largest over its replicas), from a fresh torchrun of
    the emitted script for 3 steps: in glibc's heap, what is allocated (tcmalloc's would count
    its free memory too)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    subprocess.run([str(torchrun), "--standalone", "--nproc_per_node", str(processes),
                    "train.py", "--steps", "3", "--metrics", "m.json"], cwd=out, check=True,
                   capture_output=True, env=glibc_environment())
    peaks: dict[int, float] = {}
    for rank in json.loads((out / "m.json").read_text())["ranks"]:
        peaks[rank["device"]] = max(peaks.get(rank["device"], 0.0), rank["peak_memory_bytes"])
    return [peaks[d] for d in sorted(peaks)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(rank: int, out: str, world_size: int, port: int, args: list[str], logs: str) -> None:
    """One rank of the emitted script, forked from the test process (as torchrun would start it)."""
    log = open(os.path.join(logs, f"rank{rank}.log"), "w", buffering=1)  # noqa: SIM115
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log  # pytest's capture objects were inherited through fork
    # PIPEC_ALLOCATOR: a forked rank keeps the test process's allocator (train.py would not
    # start it again anyway: its command line is the test runner's).
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PIPEC_ALLOCATOR="glibc")
    sys.path.insert(0, out)
    sys.argv = [os.path.join(out, "train.py"), *args]
    runpy.run_path(sys.argv[0], run_name="__main__")
    sys.stdout.flush()


def run_forked(out: Path, world_size: int, *args: str, logs: Path | None = None) -> list[float]:
    """Run ``out/train.py`` on ``world_size`` forked ranks; the printed per-step losses."""
    return losses_of(run_forked_text(out, world_size, *args, logs=logs))


def run_forked_text(out: Path, world_size: int, *args: str, logs: Path | None = None) -> str:
    """Run ``out/train.py`` on ``world_size`` forked ranks; what the ranks printed."""
    logs = logs or out.parent / f"{out.name}-logs-{world_size}"
    logs.mkdir(parents=True, exist_ok=True)
    try:
        mp.start_processes(_worker, args=(str(out), world_size, free_port(), list(args),
                                          str(logs)),
                           nprocs=world_size, join=True, start_method="fork")
    except mp.ProcessRaisedException as exc:
        text = "\n".join(p.read_text() for p in sorted(logs.glob("rank*.log")))
        pytest.fail(f"emitted script failed:\n{text[-3000:]}\n{exc}")
    return "".join(p.read_text() for p in sorted(logs.glob("rank*.log")))


def steps_of(text: str) -> dict[int, float]:
    """Each printed step's loss, by step (a resumed run starts after 1)."""
    return {int(k): float(v) for k, v in STEP_LINE.findall(text)}


def losses_of(text: str) -> list[float]:
    """The loss of each step, from the script's ``step {k} loss {v}`` lines."""
    steps = [(int(k), float(v)) for k, v in STEP_LINE.findall(text)]
    assert [k for k, _ in steps] == list(range(1, len(steps) + 1)), text
    return [v for _, v in steps]


def run_as_pipeline(stages_module: Any, model: torch.nn.Module,
                    inputs: tuple[torch.Tensor, ...]) -> Any:
    """The emitted stages in order, fed as torch.distributed.pipelining feeds them: each later
    stage receives fresh leaf tensors with the ``requires_grad`` its INPUTS declare (which must
    be what the sender's outputs have), and backward runs stage by stage from the sum of the
    squared output, each stage's input gradients being the previous stage's output gradients.
    Returns the output; the model's parameters hold the gradients."""
    stages = [stage_class(model) for stage_class in stages_module.STAGES]
    received: list[tuple[torch.Tensor, ...]] = []
    sent: list[tuple[torch.Tensor, ...]] = []
    values, output = tuple(inputs), None
    for k, stage in enumerate(stages):
        if k > 0:
            assert [v.requires_grad for v in values] == [g for _, _, g in stage.INPUTS], k
            values = tuple(v.detach().requires_grad_(g) for v, (_, _, g) in zip(
                values, stage.INPUTS, strict=True))
        received.append(values)
        output = stage(*values)
        sent.append(output if isinstance(output, tuple) else (output,))
        values = sent[-1]
    if any(t.requires_grad for t in sent[-1]):
        sum(t.square().sum() for t in sent[-1] if t.requires_grad).backward()
    for k in reversed(range(len(stages) - 1)):
        pairs = [(out, leaf.grad) for out, leaf in zip(sent[k], received[k + 1], strict=True)
                 if out.requires_grad and leaf.grad is not None]
        if pairs:
            torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
    return output


def composed_stages(out: Path, batch_size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The emitted stages run one after another on a CPU (no gradients) on a sample batch, and
    the model file's own model on the same batch (its ``logits`` when it returns an object)."""
    with emitted_modules(out) as (user_model, stages):
        torch.manual_seed(0)
        model = user_model.build_model().eval()
        inputs = user_model.sample_batch(batch_size)[0]
        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        values: tuple[torch.Tensor, ...] = inputs
        with torch.no_grad():
            for stage_class in stages.STAGES:
                result = stage_class(model)(*values)
                values = result if isinstance(result, tuple) else (result,)
            expected = model(*inputs)
    return values[0], getattr(expected, "logits", expected)


def emitted_train(out: Path) -> ModuleType:
    """The emitted train.py as a module (not run), with its model and stages."""
    with emitted_modules(out):
        spec = importlib.util.spec_from_file_location("emitted_train", out / "train.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


DEVICE = {"name": "gpu-like", "fp32_flops": 1e12, "bf16_flops": 1e12, "memory_bandwidth": 1e13,
          "intra_node_bandwidth": 1e10, "inter_node_bandwidth": 1e9,
          "intra_node_latency_s": 1e-6, "inter_node_latency_s": 1e-5,
          "kernel_overhead_s": 1e-7, "efficiency": 0.5}


def device_file(tmp_path: Path, usable: float | None = None) -> str:
    """A GPU-like device file with 1 GiB, or with ``usable`` bytes usable (between two plans'
    peaks, say)."""
    path = tmp_path / f"device-{usable}.json"
    path.write_text(json.dumps({**DEVICE, "memory_bytes": 2**30}))
    if usable is not None:
        device = load_devices(str(path), 1)[0]
        at_zero = usable_memory(replace(device, memory_bytes=0))
        per_gib = usable_memory(device) - at_zero
        path.write_text(json.dumps({**DEVICE, "memory_bytes": int((usable - at_zero) / per_gib
                                                                  * 2**30)}))
    return str(path)
