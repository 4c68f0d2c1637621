"""Emit pass: render the templates and write the output directory atomically.

Everything is written to a temporary directory beside the target and renamed into place only
when complete, so a failure never leaves a partial output. Output is deterministic: no
timestamps, no absolute paths, sorted JSON keys.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from types import ModuleType
from typing import Any

import jinja2

from pipec import __version__
from pipec.costmodel import StageMemory, usable_memory
from pipec.errors import OutputError
from pipec.loader import ModelSpec
from pipec.normalize import NormPlan
from pipec.planner import Plan, PlanRequest
from pipec.report import (
    baseline_table,
    max_batch_table,
    norm_table,
    search_table,
    stage_table,
    timeline_svg,
)
from pipec.schedule import SCHEDULES
from pipec.split import Boundary, Staged
from pipec.trace import Traced

MARKER = "plan.json"  # a directory holding this (and train.py) is a previous pipec output
SCHEDULE_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                    "interleaved": "ScheduleInterleaved1F1B"}
SCHEDULE_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "interleaved 1F1B"}
DEFAULT_LR = {"sgd": 0.01, "adamw": 0.001}
assert set(SCHEDULE_CLASSES) == set(SCHEDULES)


@dataclass(frozen=True)
class Emitted:
    out: Path
    files: tuple[str, ...]


def emit(spec: ModelSpec, traced: Traced, plan: Plan, norms: NormPlan, staged: Staged,
         out: Path, force: bool = False,
         finish: Callable[[Path], tuple[str, ...]] | None = None) -> Emitted:
    """Write every file into a staging directory, run ``finish`` on it (more files, e.g. ONNX),
    and only then swap it into place of ``out``: a failure leaves ``out`` as it was."""
    _check_target(out, force)
    contents = render(spec, traced, plan, norms, staged)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for name, data in contents.items():
            _write(staging / name, data)
        extra = finish(staging) if finish else ()
        _replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return Emitted(out, tuple(sorted((*contents, *extra))))


def render(spec: ModelSpec, traced: Traced, plan: Plan, norms: NormPlan,
           staged: Staged) -> dict[str, bytes]:
    """Every output file's bytes, by name."""
    context = _context(spec, traced, plan, norms)
    return {
        "model.py": spec.source,
        "train.py": _render("train.py.j2", context),
        "stages.py": _render("stages.py.j2", {**context, **_stage_context(plan, norms, staged)}),
        "report.md": _render("report.md.j2", {**context, **_report_context(plan, norms)}),
        "plan.json": (json.dumps(plan_dict(plan, norms, traced), indent=2, sort_keys=True)
                      + "\n").encode(),
        "timeline.svg": timeline_svg(plan.simulation, plan.pp, _timeline_title(plan)).encode(),
    }


def plan_dict(plan: Plan, norms: NormPlan, traced: Traced) -> dict[str, Any]:
    """plan.json: the stable keys of DESIGN.md (add freely, rename never)."""
    request = plan.request
    return {
        "gpus": request.gpus, "nodes": request.nodes, "pp": plan.pp, "dp": plan.dp,
        "global_batch": request.global_batch, "micro_batch": plan.micro_batch,
        "num_micro_batches": plan.num_micro_batches, "schedule": plan.schedule,
        "hardware": request.hardware, "optimizer": request.training.optimizer,
        "precision": request.training.precision, "frontend": traced.frontend,
        "calibration": request.calibration.device if request.calibration else None,
        "calibration_node_times": bool(request.calibration and request.calibration.nodes),
        "inputs": list(traced.input_names),
        "stages": [{
            "index": s.index, "modules": list(s.modules), "params": s.params,
            "fwd_flops": s.fwd_flops, "bwd_flops": s.bwd_flops,
            "activation_bytes": s.activation_bytes, "memory_bytes": s.memory_bytes,
            "time_s": s.time_s, "compute_s": s.compute_s, "boundary_bytes": s.boundary_bytes,
            "nodes": [s.start, s.end], "device": s.device, "fwd_s": s.fwd_s, "bwd_s": s.bwd_s,
            "memory": _memory_terms(s.memory),
        } for s in plan.stages],
        "predicted": {
            "iteration_s": plan.iteration_s, "samples_per_s": plan.samples_per_s,
            "bubble": plan.simulation.bubble,
            "peak_memory_bytes": list(plan.device_memory_bytes),
            "memory_terms": [{**_sum_terms(s.memory for s in plan.stages if s.device == d),
                              "runtime": plan.device_memory_bytes[d] - sum(
                                  s.memory_bytes for s in plan.stages if s.device == d)}
                             for d in range(plan.pp)],
        },
        "virtual_stages": plan.virtual_stages,
        "devices": [d.name for d in request.devices],
        "search": {"evaluated": len(plan.candidates), "pruned": plan.pruned},
        "candidates": [{
            "micro_batch": c.micro_batch, "num_micro_batches": c.num_micro_batches,
            "schedule": c.schedule, "samples_per_s": c.samples_per_s, "pp": c.pp, "dp": c.dp,
            "virtual_stages": c.virtual_stages,
            "peak_memory_bytes": c.peak_memory_bytes, "feasible": c.feasible,
        } for c in plan.candidates],
        "baselines": [{
            "name": b.name, "micro_batch": b.micro_batch, "schedule": b.schedule,
            "samples_per_s": b.samples_per_s, "feasible": b.feasible,
        } for b in plan.baselines],
        "max_batch": {
            "pipec": plan.max_batch[0].batch,
            "baselines": {m.method: m.batch for m in plan.max_batch[1:]},
            "limit": plan.max_batch_limit,
            "capped": [m.method for m in plan.max_batch if m.capped],
        },
        "strategy": request.strategy,
        "norm": norms.choice,
        "norm_rewrites": [{"module": r.module, "from": r.from_, "to": r.to, "groups": r.groups}
                          for r in norms.rewrites],
    }


def _memory_terms(memory: StageMemory | None) -> dict[str, float]:
    return {} if memory is None else asdict(memory)


def _sum_terms(memories: Iterable[StageMemory | None]) -> dict[str, float]:
    """A device's memory by term: the sum over its stages."""
    total: dict[str, float] = {}
    for memory in memories:
        for term, value in _memory_terms(memory).items():
            total[term] = total.get(term, 0.0) + value
    return total


def plan_id(plan_json: dict[str, Any]) -> str:
    """A short hash of plan.json's content: the emitted script's PLAN_ID, which checkpoints and
    metrics carry so that they are never matched to another plan."""
    return hashlib.sha256(json.dumps(plan_json, sort_keys=True).encode()).hexdigest()[:16]


def run_commands(plan: Plan) -> tuple[str, ...]:
    gpus, nodes = plan.request.gpus, plan.request.nodes
    if nodes == 1:
        return (f"torchrun --standalone --nproc_per_node {gpus} train.py --steps 100",)
    return (f"# on each of the {nodes} nodes (HOST:PORT = the first node's address, a free port):",
            f"torchrun --nnodes {nodes} --nproc_per_node {gpus // nodes} --rdzv-backend c10d "
            "--rdzv-endpoint HOST:PORT train.py --steps 100")


def _context(spec: ModelSpec, traced: Traced, plan: Plan, norms: NormPlan) -> dict[str, Any]:
    request = plan.request
    return {
        "version": __version__, "model_file": spec.path.name, "pp": plan.pp, "dp": plan.dp,
        "num_stages": len(plan.stages), "virtual_stages": plan.virtual_stages,
        "gpus": request.gpus, "nodes": request.nodes, "hardware": request.hardware,
        "global_batch": request.global_batch, "micro_batch": plan.micro_batch,
        "num_micro_batches": plan.num_micro_batches, "schedule": plan.schedule,
        "schedule_name": SCHEDULE_NAMES[plan.schedule],
        "schedule_class": SCHEDULE_CLASSES[plan.schedule],
        "optimizer": request.training.optimizer, "precision": request.training.precision,
        "default_lr": DEFAULT_LR[request.training.optimizer], "frontend": traced.frontend,
        "predicted_iteration": _duration(plan.iteration_s),
        "predicted_throughput": f"{plan.samples_per_s:,.1f}",
        "predicted_bubble": f"{plan.simulation.bubble:.1%}",
        "time_source": _time_source(request),
        "run_commands": run_commands(plan), "norm_choice": norms.choice,
        "plan_id": plan_id(plan_dict(plan, norms, traced)),
    }


def _time_source(request: PlanRequest) -> str:
    calibration = request.calibration
    if calibration is None:
        return f"the `{request.hardware}` roofline"
    if calibration.nodes:
        return f"this model's node times measured by `pipec profile` ({calibration.device})"
    return f"constants fitted by `pipec profile` ({calibration.device})"


def _stage_context(plan: Plan, norms: NormPlan, staged: Staged) -> dict[str, Any]:
    stages = [{
        "index": code.index, "class_name": code.class_name, "module_paths": code.module_paths,
        "summary": _summary(stage.modules, stage.end - stage.start),
        "forward": _indent(code.forward_source),
        "input_specs": _specs_literal(code.input_specs),
        "output_specs": _specs_literal(code.output_specs),
    } for code, stage in zip(staged.stages, plan.stages, strict=True)]
    return {"stages": stages, "imports": staged.imports, "norm_rewrites": norms.rewrites,
            "tied": staged.tied}


def _report_context(plan: Plan, norms: NormPlan) -> dict[str, Any]:
    return {
        "stage_table": stage_table(plan), "search_table": search_table(plan),
        "baseline_table": baseline_table(plan), "norm_table": norm_table(norms),
        "max_batch_table": max_batch_table(plan),
        "num_candidates": len(plan.candidates), "num_pruned": plan.pruned,
        "num_fitting": sum(c.feasible for c in plan.candidates),
        "max_batch_limit": f"{plan.max_batch_limit:,}",
        "predicted_peak": _gib(max(plan.device_memory_bytes)),
        "device_memory": _gib(min(usable_memory(d) for d in plan.request.devices)),
    }


def _summary(modules: tuple[str, ...], num_nodes: int) -> str:
    names = ", ".join(modules) if len(modules) <= 8 else (
        ", ".join(modules[:4]) + f", ... {modules[-1]}")
    return f"{names or 'functions'} ({num_nodes} graph nodes)"


def _specs_literal(specs: tuple[Boundary, ...]) -> str:
    """A Python literal: a tuple of (shape, dtype, requires_grad)."""
    items = [f'({b.shape!r}, "{b.dtype}", {b.requires_grad})' for b in specs]
    return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"


def _indent(source: str) -> str:
    return "\n".join(("    " + line) if line else "" for line in source.splitlines())


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds < 1 else f"{seconds:.3f} s"


def _gib(value: float) -> str:
    return f"{value / 2**30:.2f} GiB"


def _timeline_title(plan: Plan) -> str:
    return (f"{SCHEDULE_NAMES[plan.schedule]}: {len(plan.stages)} stages on {plan.pp} devices, "
            f"{plan.num_micro_batches} "
            f"micro-batches of {plan.micro_batch}")


_environment = jinja2.Environment(
    loader=jinja2.FunctionLoader(
        lambda name: resources.files("pipec.templates").joinpath(name).read_text()),
    undefined=jinja2.StrictUndefined, keep_trailing_newline=True, trim_blocks=True,
    lstrip_blocks=True, autoescape=False)


def _render(name: str, context: dict[str, Any]) -> bytes:
    return _environment.get_template(name).render(**context).encode()


def _check_target(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise OutputError(f"output {out} exists and is not a directory; choose another -o")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file() and not force:
        raise OutputError(f"output directory {out} exists and is not a pipec output; "
                          "choose another -o or pass --force to replace it")


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _replace(staging: Path, out: Path) -> None:
    """Swap the finished staging directory into place of ``out``."""
    os.chmod(staging, 0o755)
    if not out.exists():
        staging.rename(out)
        return
    retired = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
    retired.rmdir()
    out.rename(retired)
    staging.rename(out)
    shutil.rmtree(retired, ignore_errors=True)


@contextlib.contextmanager
def emitted_modules(directory: Path) -> Iterator[tuple[ModuleType, ModuleType]]:
    """Import the emitted model.py and stages.py as train.py does, then forget them."""
    saved: dict[str, ModuleType] = {name: sys.modules.pop(name) for name in ("model", "stages")
                                    if name in sys.modules}
    sys.path.insert(0, str(directory))
    try:
        yield _import(directory, "model"), _import(directory, "stages")
    finally:
        sys.path.remove(str(directory))
        for name in ("model", "stages"):
            sys.modules.pop(name, None)
        sys.modules.update(saved)


def _import(directory: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, directory / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
