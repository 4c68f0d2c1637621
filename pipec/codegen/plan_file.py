"""plan.json: the plan as data, with stable keys (add freely, rename never; docs/runtime.md),
and its identity (the hash train.py, its checkpoints and its metrics carry)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

from pipec.cost.hardware import action_s, for_replicas
from pipec.cost.stage_memory import StageMemory
from pipec.frontend.fakedevice import short_read
from pipec.frontend.normalization import NormPlan
from pipec.frontend.trace import Traced
from pipec.planning.device_peak import apart_bytes
from pipec.planning.evaluate import group_figures_used
from pipec.planning.planner import Plan
from pipec.planning.points import shared_cores
from pipec.planning.values import PlanRequest


def plan_dict(plan: Plan, norms: NormPlan, traced: Traced) -> dict[str, Any]:
    """plan.json: stable keys, a contract with users and tests (add freely, rename never)."""
    request = plan.request
    return {
        "gpus": plan.processes, "nodes": request.nodes, "pp": plan.pp, "dp": plan.dp,
        "global_batch": request.global_batch, "micro_batch": plan.micro_batch,
        "num_micro_batches": plan.num_micro_batches, "schedule": plan.schedule,
        "hardware": request.hardware, "optimizer": request.training.optimizer,
        "precision": request.training.precision, "frontend": traced.frontend,
        "calibration": request.calibration.device if request.calibration else None,
        "calibration_node_times": bool(request.calibration and request.calibration.nodes),
        "inputs": list(traced.input_names),
        "traced_on": traced.device,
        "device_reads": [short_read(r) for r in traced.device_reads],
        "stages": [{
            "index": s.index, "modules": list(s.modules), "params": s.params,
            "fwd_flops": s.fwd_flops, "bwd_flops": s.bwd_flops,
            "activation_bytes": s.activation_bytes, "memory_bytes": s.memory_bytes,
            "time_s": s.time_s, "compute_s": s.compute_s, "boundary_bytes": s.boundary_bytes,
            "nodes": [s.start, s.end], "device": s.device, "fwd_s": s.fwd_s, "bwd_s": s.bwd_s,
            "memory": _memory_terms(s.memory), "recompute": s.recompute,
        } for s in plan.stages],
        "predicted": {
            "iteration_s": plan.iteration_s, "samples_per_s": plan.samples_per_s,
            "bubble": plan.idle_share,  # of the whole step, all-reduce and runtime included
            "step_terms": plan.step_terms,  # seconds besides the schedule, by term
            "runtime_overhead_s": {
                "per_action": action_s(request.devices, plan.schedule),
                "per_step": max(d.step_overhead_s for d in request.devices),
                # An input sent before its receiver asked for it (pipec.calibration.receive_times).
                "per_late_receive": max(d.late_receive_s for d in request.devices),
                # Per send or receive an action posts to another device (beside per_action).
                "per_post": max(d.p2p_post_s for d in request.devices)},
            # Inside step_terms' all_reduce term, as measured within a node (0: not): each
            # collective's wait after compute, and the work per gradient tensor (with the
            # ring's latency and bytes and the replicas' lead: blocking_all_reduce's drift × √
            # of the step's compute), under DDP and FSDP alike; measured_on: on every process,
            # or on the plan's dp of them while the others waited (Device.replica_collectives),
            # or "no replicas" / "not measured".
            "data_parallel": _data_parallel(plan),
            "shared_cores": _shared_cores(request, plan.dp),
            # Inside the stages' times: what the synchronized BatchNorms wait a step, and an
            # all-reduce blocking a pass as measured (pipec.calibration.allreduce_times; 0, 0:
            # not measured); its drift also gives the data-parallel step's lead, inside
            # step_terms.
            "synchronized_norm_s": plan.synchronized_norm_s,
            "blocking_all_reduce": {
                "latency_s": max(d.blocking_collective_s for d in request.devices),
                "drift_s_per_sqrt_s": max(d.blocking_drift for d in request.devices)},
            "peak_memory_bytes": list(plan.device_memory_bytes),
            "memory_terms": _device_terms(plan),
        },
        "virtual_stages": plan.virtual_stages,
        # The device mesh, outer dimension first: ranks r = outer index · inner size + inner.
        "mesh": (["pp", "dp"] if plan.replicas_inner else ["dp", "pp"])
        + (["tp"] if plan.tp > 1 else []),
        "tp": plan.tp,  # tensor-parallel ranks per stage replica (tp innermost in the mesh)
        # The nodes between tp regions split along the sequence (Megatron-LM's).
        "sequence_parallel": plan.sequence_parallel,
        # --tp auto: each degree tried, its predicted samples/s (null: nothing fits).
        "tp_tried": [{"tp": tp, "samples_per_s": rate} for tp, rate in plan.tp_tried],
        "recompute": request.recompute,  # asked for; each stage's choice is under "stages"
        "fsdp": plan.fsdp,  # "off" (DDP), "zero2", "zero3" or "block" (FSDP2 over the replicas)
        "decision": _decision(plan),
        "devices": [d.name for d in request.devices],
        "search": {"evaluated": len(plan.candidates), "pruned": plan.pruned},
        "candidates": [{
            "micro_batch": c.micro_batch, "num_micro_batches": c.num_micro_batches,
            "schedule": c.schedule, "samples_per_s": c.samples_per_s, "pp": c.pp, "dp": c.dp,
            "virtual_stages": c.virtual_stages, "replicas_inner": c.replicas_inner,
            "fsdp": c.fsdp,
            "peak_memory_bytes": c.peak_memory_bytes, "feasible": c.feasible,
        } for c in plan.candidates],
        "baselines": [{
            "name": b.strategy, "micro_batch": b.micro_batch, "schedule": b.schedule,
            "samples_per_s": b.samples_per_s, "feasible": b.feasible,
        } for b in plan.baselines],
        "max_batch": {
            "pipec": plan.max_batch[0].batch,
            "baselines": {m.strategy: m.batch for m in plan.max_batch[1:]},
            "limit": plan.max_batch_limit,
            "capped": [m.strategy for m in plan.max_batch if m.capped],
        },
        "strategy": request.strategy,
        "norm": norms.choice,
        "norm_rewrites": [{"module": r.module, "from": r.from_, "to": r.to, "groups": r.groups}
                          for r in norms.rewrites],
    }


def _decision(plan: Plan) -> dict[str, Any] | None:
    """The margin a more complex plan needed, and the runner-up (null under --strategy)."""
    decision = plan.decision
    if decision is None:
        return None
    runner = decision.runner_up
    return {"margin": decision.margin, "kept_simpler": decision.kept_simpler,
            "runner_up": None if runner is None else {
                "pp": runner.pp, "dp": runner.dp, "micro_batch": runner.micro_batch,
                "schedule": runner.schedule, "virtual_stages": runner.virtual_stages,
                "fsdp": runner.fsdp,
                "samples_per_s": runner.samples_per_s,
                "step_time_relative": decision.runner_up_relative}}


def _data_parallel(plan: Plan) -> dict[str, Any]:
    """The data-parallel figures the plan's replicas pay within a node, the slowest device's."""
    request, replicas = plan.request, plan.dp
    apart = group_figures_used(request, plan.pp, replicas, plan.replicas_inner)
    devices = [for_replicas(d, replicas) if apart else d for d in request.devices]
    wait = max(d.step_collective_s for d in devices)
    per_tensor = max(d.gradient_tensor_s for d in devices)
    where = (f"{replicas} of {request.gpus // request.nodes} processes, the others waiting"
             if apart else "no replicas" if replicas < 2
             else "every process" if wait or per_tensor else "not measured")
    return {"wait_per_all_reduce_s": wait, "per_gradient_tensor_s": per_tensor,
            "measured_on": where}


def _shared_cores(request: PlanRequest, replicas: int) -> dict[str, Any] | None:
    """CPU processes sharing cores (pipec.cost.cores); null where each device computes alone."""
    cores = shared_cores(request, replicas)
    if cores is None:
        return None
    return {"contention": cores.contention, "processes": cores.processes,
            "lent_in_bubbles": cores.shared, "probe_times_scale": cores.paired,
            # Per n = 1 … P processes computing at once, each one's time ÷ its time alone.
            "slowdowns": [cores.slowdown(n) for n in range(1, cores.processes + 1)]}


def _memory_terms(memory: StageMemory | None) -> dict[str, float]:
    return {} if memory is None else asdict(memory)


def _device_terms(plan: Plan) -> list[dict[str, float]]:
    """Per device, its peak by term: its stages' terms summed, less what they never hold at
    once (``not_at_once``, pipec.planning.device_peak, as the planner subtracted it), and the
    runtime's own bytes."""
    memories = [s.memory for s in plan.stages]
    apart = ((0.0,) * plan.pp if any(m is None for m in memories) else
             apart_bytes(plan.schedule, plan.pp, plan.num_micro_batches, plan.virtual_stages,
                         [m for m in memories if m is not None],
                         [s.recompute for s in plan.stages]))
    terms = []
    for device in range(plan.pp):
        stages = [s for s in plan.stages if s.device == device]
        terms.append({**_sum_terms(s.memory for s in stages), "not_at_once": -apart[device],
                      "runtime": plan.device_memory_bytes[device]
                      - sum(s.memory_bytes for s in stages) + apart[device]})
    return terms


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
