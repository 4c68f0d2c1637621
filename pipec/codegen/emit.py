"""Emit pass: render the templates and write the output directory atomically.

Everything is written to a temporary directory beside the target and renamed into place only
when complete, so a failure never leaves a partial output. Output is deterministic: no
timestamps, no absolute paths, sorted JSON keys.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from types import ModuleType
from typing import Any

import jinja2
import torch

from pipec import __version__, host_allocator
from pipec.codegen.output_dir import check_target, write_atomically
from pipec.codegen.plan_file import plan_dict, plan_id
from pipec.codegen.report import (
    baseline_table,
    decision_text,
    device_text,
    max_batch_table,
    norm_table,
    search_table,
    stage_table,
    timeline_svg,
)
from pipec.codegen.split import Boundary, Staged
from pipec.cost.hardware import action_s
from pipec.cost.model import rank_of, usable_memory
from pipec.errors import ModelFileError
from pipec.frontend.loader import ModelSpec
from pipec.frontend.normalization import NormPlan, to_group_norm_source
from pipec.frontend.trace import Traced
from pipec.planning.evaluate import group_figures_used
from pipec.planning.planner import Plan, PlanRequest
from pipec.planning.points import Layout, communicators
from pipec.planning.schedules import SCHEDULE_CLASSES, ZERO_BUBBLE
from pipec.planning.sharding import BLOCK
from pipec.torchcompat import SUPPORTED_PIP, SUPPORTED_TORCH
from pipec.units import duration, gib, module_list

SCHEDULE_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "interleaved 1F1B",
                  "interleaved-zb": "interleaved zero bubble (ZB-1P)",
                  "zbv": "zero bubble V (ZB-V)"}
DEFAULT_LR = {"sgd": 0.01, "adamw": 0.001}


@dataclass(frozen=True)
class Emitted:
    out: Path
    files: tuple[str, ...]


def emit(spec: ModelSpec, traced: Traced, plan: Plan, norms: NormPlan, staged: Staged,
         out: Path, force: bool = False,
         finish: Callable[[Path], tuple[str, ...]] | None = None) -> Emitted:
    """Write every file into a staging directory, run ``finish`` on it (more files, e.g. ONNX),
    and only then swap it into place of ``out``: a failure leaves ``out`` as it was."""
    check_target(out, force)
    return Emitted(out, write_atomically(out, render(spec, traced, plan, norms, staged), finish))


def render(spec: ModelSpec, traced: Traced, plan: Plan, norms: NormPlan,
           staged: Staged) -> dict[str, bytes]:
    """Every output file's bytes, by name."""
    plan_json = plan_dict(plan, norms, traced)
    context = _context(spec, traced, plan, norms, plan_id(plan_json))
    return {
        "model.py": spec.source,
        "train.py": _render("train.py.j2", context),
        "stages.py": _render("stages.py.j2", {**context, **_stage_context(plan, norms, staged),
                                              "constants": _constants(traced, staged)}),
        "weights.py": _render("weights.py.j2", context),
        "checkpoints.py": _render("checkpoints.py.j2", context),
        "gradients.py": _render("gradients.py.j2", context),
        "pipeline.py": _render("pipeline.py.j2", context),
        "metrics.py": _render("metrics.py.j2", context),
        "data.py": _render("data.py.j2", context),
        "evaluation.py": _render("evaluation.py.j2", context),
        "torch_compat.py": _render("torch_compat.py.j2", context),
        "allocator.py": _copied_module(host_allocator),
        **({"tensor_parallel.py": _render("tensor_parallel.py.j2",
                                          {**context, "tp_shards": staged.tp_shards})}
           if plan.tp > 1 else {}),
        "logs.py": _render("logs.py.j2", context),
        "launch.sh": _render("launch.sh.j2", context),
        "launch.slurm": _render("launch.slurm.j2", context),
        "report.md": _render("report.md.j2", {**context, **_report_context(plan, norms),
                                              "tp_tensors": len(staged.tp_shards),
                                              "tp_tried": _tp_tried(plan)}),
        "plan.json": (json.dumps(plan_json, indent=2, sort_keys=True) + "\n").encode(),
        "timeline.svg": timeline_svg(plan.simulation, plan.pp, _timeline_title(plan)).encode(),
    }


def run_commands(plan: Plan) -> tuple[str, ...]:
    gpus, nodes = plan.processes, plan.request.nodes
    if nodes == 1:
        return (f"torchrun --standalone --nproc_per_node {gpus} train.py --steps 100",)
    return (f"# on each of the {nodes} nodes (HOST:PORT = the first node's address, a free port):",
            f"torchrun --nnodes {nodes} --nproc_per_node {gpus // nodes} --rdzv-backend c10d "
            "--rdzv-endpoint HOST:PORT train.py --steps 100")


def _context(spec: ModelSpec, traced: Traced, plan: Plan, norms: NormPlan,
             identity: str) -> dict[str, Any]:
    request = plan.request
    return {
        "version": __version__, "model_file": spec.path.name, "pp": plan.pp, "dp": plan.dp,
        "job_name": spec.path.stem, "gpus_per_node": plan.processes // request.nodes,
        # A stage's FLOPs are one tp rank's: tp of them make the model's (the few nodes every
        # rank runs whole, norms and residual adds, counted tp times).
        "flops_per_sample": plan.tp * sum(s.fwd_flops + s.bwd_flops for s in plan.stages)
        / plan.micro_batch,
        # The request's devices are the tp groups: each holds tp of them.
        "peak_flops": plan.tp * sum(
            d.bf16_flops if request.training.precision == "bf16" else d.fp32_flops
            for d in request.devices),
        "gpu": any(d.device_type == "cuda" for d in request.devices),
        "num_stages": len(plan.stages), "virtual_stages": plan.virtual_stages,
        "stage_devices": [s.device for s in plan.stages],
        "split_backward": plan.schedule in ZERO_BUBBLE,
        "replicas_inner": plan.replicas_inner, "fsdp": plan.fsdp,
        "gpus": plan.processes, "tp": plan.tp, "sequence_parallel": plan.sequence_parallel,
        "nodes": request.nodes, "hardware": request.hardware,
        "global_batch": request.global_batch, "micro_batch": plan.micro_batch,
        "num_micro_batches": plan.num_micro_batches, "schedule": plan.schedule,
        "schedule_name": SCHEDULE_NAMES[plan.schedule],
        "schedule_class": SCHEDULE_CLASSES[plan.schedule],
        "optimizer": request.training.optimizer, "precision": request.training.precision,
        "default_lr": DEFAULT_LR[request.training.optimizer], "frontend": traced.frontend,
        "device_note": device_text(traced.device, traced.device_reads),
        "output_structure": repr(traced.output_structure) if traced.output_structure else "",
        "output_type": _output_type(traced.output_structure),
        "predicted_iteration": duration(plan.iteration_s),
        "predicted_throughput": f"{plan.samples_per_s:,.1f}",
        "predicted_bubble": f"{plan.idle_share:.1%}",
        "step_terms": ", ".join(f"{_term_label(name, plan)} {duration(seconds)}"
                                for name, seconds in plan.step_terms.items()),
        "time_source": _time_source(request) + _runtime_overhead(request, plan.schedule),
        "run_commands": run_commands(plan), "norm_choice": norms.choice,
        "plan_id": identity, "supported_torch": SUPPORTED_TORCH, "supported_pip": SUPPORTED_PIP,
    }


def _output_type(structure: str | None) -> str:
    """The name of the model output's type, from torch's pytree JSON ([version, root node])."""
    return "" if structure is None else str(json.loads(structure)[1]["type"]).split(".")[-1]


def _term_label(name: str, plan: Plan) -> str:
    """A step term's name in the report (plan.json keeps the key): under FSDP the data-parallel
    term is its all-gathers and reduce-scatter."""
    if name != "all_reduce":
        return name.replace("_", "-")
    label = {"off": "all-reduce", "block": "FSDP all-gathers and reduce-scatters"}.get(
        plan.fsdp, "FSDP all-gathers and reduce-scatter")
    if group_figures_used(plan.request, plan.pp, plan.dp, plan.replicas_inner):
        per_node = plan.request.gpus // plan.request.nodes
        label += (f" (its waits as measured on {plan.dp} of {per_node} processes while the "
                  "others waited)")
    return label


def _time_source(request: PlanRequest) -> str:
    calibration = request.calibration
    if calibration is None:
        return f"the `{request.hardware}` roofline"
    if calibration.source != "pipec profile":
        kind = "this model's node times" if calibration.nodes else "constants fitted to times"
        return f"{kind} {calibration.source}"
    if calibration.nodes:
        return f"this model's node times measured by `pipec profile` ({calibration.device})"
    return f"constants fitted by `pipec profile` ({calibration.device})"


def _runtime_overhead(request: PlanRequest, schedule: str) -> str:
    action = action_s(request.devices, schedule)
    step = max(d.step_overhead_s for d in request.devices)
    if not (action or step):
        return "; the training runtime's own time is not measured for this hardware"
    late = max(d.late_receive_s for d in request.devices)
    post = max(d.p2p_post_s for d in request.devices)
    posts = f", {duration(post)} per send or receive to another device" if post else ""
    waits = (f", {duration(late)} per input sent before its receiver asked for it"
             if late else "")
    return (f"; the training runtime's own time, {duration(action)} per forward or backward "
            f"action{posts}{waits} and {duration(step)} per step, is included")


def _stage_context(plan: Plan, norms: NormPlan, staged: Staged) -> dict[str, Any]:
    stages = [{
        "index": code.index, "class_name": code.class_name, "module_paths": code.module_paths,
        "summary": f"{module_list(stage.modules, 8)} ({stage.end - stage.start} graph nodes)",
        "forward": _indent(code.forward_source),
        "input_specs": _specs_literal(code.input_specs),
        "output_specs": _specs_literal(code.output_specs),
        "recompute": stage.recompute,
        "copy_outputs": plan.schedule in ZERO_BUBBLE and stage.index < len(plan.stages) - 1,
        "sequence_parameters": code.sequence_parameters,
        "fsdp_units": code.fsdp_units if plan.fsdp == BLOCK else (),
    } for code, stage in zip(staged.stages, plan.stages, strict=True)]
    # A batch norm computed inside a module's forward is already a group_norm in the graph.
    swapped = tuple(r for r in norms.rewrites if not r.node)
    return {"stages": stages, "imports": staged.imports, "norm_rewrites": swapped,
            "tied": staged.tied, "group_norm": any(r.to == "GroupNorm" for r in swapped),
            "sync_batch_norm": norms.synchronized, "to_group_norm": to_group_norm_source()}


def _tp_tried(plan: Plan) -> str:
    """--tp auto's degrees and their predicted throughput, for the report."""
    return "; ".join(f"tp {tp}: " + (f"{rate:,.1f} samples/s" if rate else "nothing fits")
                     for tp, rate in plan.tp_tried)


def _report_context(plan: Plan, norms: NormPlan) -> dict[str, Any]:
    return {
        "stage_table": stage_table(plan), "search_table": search_table(plan),
        "baseline_table": baseline_table(plan), "norm_table": norm_table(norms, plan),
        "decision": decision_text(plan),
        "max_batch_table": max_batch_table(plan),
        "num_candidates": len(plan.candidates), "num_pruned": plan.pruned,
        "num_fitting": sum(c.feasible for c in plan.candidates),
        "max_batch_limit": f"{plan.max_batch_limit:,}",
        "predicted_peak": gib(max(plan.device_memory_bytes)),
        "device_memory": gib(usable_on_fullest(plan)),
    }


def usable_on_fullest(plan: Plan) -> float:
    """The usable memory of the device whose predicted peak is highest: its communicators
    (pipec.planning.points.communicators) counted."""
    layout = Layout(plan.pp, plan.dp, plan.virtual_stages, plan.schedule == "zbv",
                    plan.replicas_inner, plan.fsdp)
    position = max(range(plan.pp), key=lambda p: plan.device_memory_bytes[p])
    ranks = [rank_of(position, r, plan.pp, plan.dp, plan.replicas_inner) for r in range(plan.dp)]
    return min(usable_memory(plan.request.devices[r],
                             *communicators(layout, position, plan.request.tp))
               for r in ranks)


# A constant the traced code made is written into stages.py as a literal up to this many values.
MAX_CONSTANT_VALUES = 4096


def _constants(traced: Traced, staged: Staged) -> list[tuple[str, str]]:
    """(path, literal) of each constant the stages use that the model does not hold."""
    used = {path for code in staged.stages for path in code.module_paths}
    return [(path, _tensor_literal(path, value)) for path, value in traced.constants
            if path in used]


def _tensor_literal(path: str, value: torch.Tensor) -> str:
    if value.numel() > MAX_CONSTANT_VALUES:
        raise ModelFileError(
            f"the model's forward makes a tensor of {value.numel():,} values from Python data "
            f"({path}), which the stages would carry as a literal; make it once in __init__ "
            "with self.register_buffer, so that they take it from the model")
    return f"torch.tensor({value.tolist()!r}, dtype={value.dtype})"


def _specs_literal(specs: tuple[Boundary, ...]) -> str:
    """A Python literal: a tuple of (shape, dtype, requires_grad)."""
    items = [f'({b.shape!r}, "{b.dtype}", {b.requires_grad})' for b in specs]
    return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"


def _indent(source: str) -> str:
    return "\n".join(("    " + line) if line else "" for line in source.splitlines())


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


def _copied_module(module: ModuleType) -> bytes:
    """A module of pipec's own that needs only the standard library, as the emitted scripts
    import it: one source for pipec and the scripts."""
    return (f"# {module.__name__} of pipec {__version__}, copied.\n"
            + inspect.getsource(module)).encode()


