"""The calibrated CPU time model against measurement, stage by stage.

For each sample: `pipec profile` it (CPU), compile it for 2 devices with that calibration, then
run every emitted stage for real on the CPU at the plan's micro-batch size and time its forward
and backward (fastest of --repeats), against the plan's predicted compute time (`compute_s`).

    python benchmarks/calibration.py [--repeats 30] [--gpus 2] [--batch-size 64]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from tabulate import tabulate

from pipec.calibrate import profile_model, save_calibration
from pipec.driver import CompileOptions, compile_model

SAMPLES = Path(__file__).resolve().parent.parent / "samples"


def load(out: Path) -> tuple[ModuleType, ModuleType]:
    """The emitted model.py and stages.py, imported as the training script imports them."""
    sys.path.insert(0, str(out))
    modules = []
    for name in ("model", "stages"):
        sys.modules.pop(name, None)
        spec = importlib.util.spec_from_file_location(name, out / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        modules.append(module)
    sys.path.remove(str(out))
    return modules[0], modules[1]


def stage_inputs(stages: list[torch.nn.Module], first: tuple[torch.Tensor, ...]
                 ) -> list[tuple[torch.Tensor, ...]]:
    """Each stage's real inputs: the micro-batch pushed through the stages before it."""
    inputs = [first]
    with torch.no_grad():
        for stage in stages[:-1]:
            output = stage(*inputs[-1])
            inputs.append(output if isinstance(output, tuple) else (output,))
    return inputs


def time_stage(stage: torch.nn.Module, inputs: tuple[torch.Tensor, ...],
               specs: tuple[Any, ...], repeats: int) -> float:
    """Seconds of the stage's forward and backward, as a pipeline step runs them (fastest of
    ``repeats``: interference on a shared machine only adds time)."""
    def step() -> None:
        leaves = [t.detach().requires_grad_(grad) for t, (_, _, grad) in zip(inputs, specs,
                                                                             strict=True)]
        output = stage(*leaves)
        outputs = [o for o in (output if isinstance(output, tuple) else (output,))
                   if o.requires_grad]
        torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])

    step()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return min(times)


def measure(sample: Path, args: argparse.Namespace, tmp: Path) -> list[tuple[Any, ...]]:
    calibration, _ = profile_model(sample, 16)
    save_calibration(calibration, tmp / "calibration.json")
    out = tmp / sample.stem
    compile_model(CompileOptions(model=sample, out=out, gpus=args.gpus,
                                 batch_size=args.batch_size, hardware="cpu",
                                 calibration=tmp / "calibration.json", force=True))
    plan = json.loads((out / "plan.json").read_text())
    user, emitted = load(out)
    torch.manual_seed(0)
    model = user.build_model()
    emitted.rewrite_norms(model)
    stages = [cls(model) for cls in emitted.STAGES]
    batch, _ = user.sample_batch(plan["micro_batch"])
    first = (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)
    rows = []
    for index, (stage, inputs) in enumerate(zip(stages, stage_inputs(stages, first),
                                                strict=True)):
        measured = time_stage(stage, inputs, emitted.STAGES[index].INPUTS or tuple(
            (None, None, False) for _ in inputs), args.repeats)
        predicted = plan["stages"][index]["compute_s"]
        rows.append((sample.name, index, plan["micro_batch"], f"{predicted * 1e3:.2f}",
                     f"{measured * 1e3:.2f}", f"{predicted / measured - 1:+.1%}"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for sample in sorted(SAMPLES.glob("*.py")):
            rows += measure(sample, args, Path(tmp))
    print(tabulate(rows, ("sample", "stage", "micro-batch", "predicted ms", "measured ms",
                          "error"), tablefmt="github"))


if __name__ == "__main__":
    main()
