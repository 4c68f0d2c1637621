"""Annotate pass: per-node shapes, FLOPs and bytes, measured on meta tensors (nothing allocated).

Every cost is linear in the micro-batch size m, ``cost(m) = fixed + per_sample · m``: the pass runs
the graph twice, at batches 2 and 4, and takes the two coefficients from the difference. This
keeps batch-independent values (position ids, masks) from being scaled with the batch. Batch 1 is
avoided: with a dimension of size 1 some ops skip a copy (a reshape of a transposed view is then
free), so batch 1 does not lie on the line.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import fx, nn

from pipec.frontend.autocast import AutocastRun, autocast_dtypes, run_under_autocast
from pipec.frontend.costgraph import (
    COMPUTE_OPS,
    MEASURED_BATCHES,
    Bf16Costs,
    CostGraph,
    Linear,
    LossCost,
    NodeCost,
    ValueSpec,
)
from pipec.frontend.liveness import legal_cuts, lifetimes, live_sets, live_values, rederivable_sizes
from pipec.frontend.loader import ModelSpec
from pipec.frontend.node_costs import Measured, measure, nbytes, storage_id
from pipec.frontend.tensors import flat_tensors
from pipec.frontend.trace import Traced, batch_inputs, model_loss

log = logging.getLogger(__name__)

# Re-exported: the pass's output types are imported from here by the passes after it.
__all__ = ["COMPUTE_OPS", "MEASURED_BATCHES", "CostGraph", "Linear", "LossCost", "NodeCost",
           "ValueSpec", "annotate", "live_values"]


def annotate(traced: Traced, spec: ModelSpec, autocast_device: str = "cuda",
             bf16_memory: bool = True) -> CostGraph:
    """Measure ``traced`` and the model file's loss on sample batches of each of
    MEASURED_BATCHES, on meta tensors; and each value's dtype under ``autocast_device``'s bf16
    autocast ("cuda" or "cpu", whose rules differ). With ``bf16_memory``, also what each node
    and the loss save under that autocast (two more runs of the graph: a plan in fp32, or a
    report that shows no bf16 memory, goes without)."""
    batches = [batch_inputs(spec, size) for size in MEASURED_BATCHES]
    gm = traced.graph_module
    one, two = (measure(gm, tuple(t.to("meta") for t in inputs)) for inputs, _ in batches)
    compute = [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]
    params, buffers = _first_users(gm, compute)
    shared = _shared_bytes(gm, compute)
    nodes = tuple(_node_cost(n, one[n.name], two[n.name], params.get(n.name, ()),
                             buffers.get(n.name, 0), shared.get(n.name, 0)) for n in compute)
    made_and_used = lifetimes(gm, compute)
    sizes = {**{n.name: c.output_bytes for n, c in zip(compute, nodes, strict=True)},
             **_input_bytes(gm, one, two)}
    nodes = tuple(replace(c, working_bytes=_sum_linear(
        [c.output_bytes, *(sizes[a.name] for a in n.all_input_nodes if a.name in sizes)]))
        for n, c in zip(compute, nodes, strict=True))
    # Sizes each stage reads again (export's dynamic batch) are never sent.
    reread = rederivable_sizes(compute)
    live = live_sets({k: v for k, v in made_and_used.items() if k not in reread}, len(compute))
    held = [v for v in sizes if not one[v].saved_output]
    legal = legal_cuts(compute, made_and_used, nodes)
    loss_fn = model_loss(spec, traced)
    autocast = (run_under_autocast(gm, batches, autocast_device, loss_fn) if bf16_memory
                else AutocastRun(autocast_dtypes(gm, batches[0][0], autocast_device)))
    values = tuple(_value_spec(n.name, one[n.name].value, two[n.name].value,
                               autocast.dtypes.get(n.name, ""))
                   for n in gm.graph.nodes if n.name in made_and_used
                   and isinstance(one[n.name].value, torch.Tensor))
    ratios = _value_ratios(values)
    nodes = tuple(replace(c, bf16=_bf16_costs(n, c, autocast, ratios, sizes),
                          batch_norm_channels=_batch_norm_channels(gm, n))
                  for n, c in zip(compute, nodes, strict=True))
    outputs = [_model_output(gm, measured) for measured in (one, two)]
    loss = _loss_cost(loss_fn, spec, outputs, [targets for _, targets in batches])
    return CostGraph(nodes=nodes, legal_cuts=legal, values=values,
                     live=tuple(tuple(names) for names in live),
                     synthetic_data=not spec.has_train_dataset,
                     cut_bytes=tuple(_sum_linear(sizes[v] for v in names) for names in live),
                     held_cut_bytes=tuple(_sum_linear(sizes[v] for v in names if v in held)
                                          for names in live),
                     loss=replace(loss, saved_bytes_bf16=_linear(*autocast.loss_saved)
                                  if autocast.loss_saved else loss.saved_bytes),
                     cut_bytes_bf16=_autocast_cut_bytes(ratios, sizes, live),
                     held_cut_bytes_bf16=_autocast_cut_bytes(
                         ratios, sizes, [[v for v in names if v in held] for names in live]))

def _value_ratios(values: Sequence[ValueSpec]) -> dict[str, float]:
    """Each value's bytes under bf16 autocast ÷ in fp32 (same shape, its autocast dtype)."""
    return {v.name: _itemsize(v.autocast_dtype) / _itemsize(v.dtype) for v in values}

def _autocast_cut_bytes(ratios: dict[str, float], sizes: dict[str, Linear],
                        live: Sequence[Sequence[str]]) -> tuple[Linear, ...]:
    """Each cut's bytes with its tensors in their dtypes under autocast (same shapes)."""
    return tuple(_sum_linear(Linear(sizes[v].fixed * ratios.get(v, 1.0),
                                    sizes[v].per_sample * ratios.get(v, 1.0)) for v in names)
                 for names in live)

def _bf16_costs(n: fx.Node, cost: NodeCost, autocast: AutocastRun,
                ratios: dict[str, float], sizes: dict[str, Linear]) -> Bf16Costs:
    """A node's saved bytes as the autocast run measured them (its fp32 bytes when it could
    not run); its output and its backward's working set (its output's and inputs' gradients)
    in their autocast dtypes."""
    high = MEASURED_BATCHES[1]
    names = [v for v in (n.name, *(a.name for a in n.all_input_nodes)) if v in sizes]
    fp32 = sum(sizes[v].at(high) for v in names)
    bf16 = sum(sizes[v].at(high) * ratios.get(v, 1.0) for v in names)
    saved = (_linear(*(at.get(n.name, 0) for at in autocast.saved)) if autocast.saved
             else cost.saved_bytes)
    return Bf16Costs(saved_bytes=saved, output_ratio=ratios.get(n.name, 1.0),
                     working_ratio=bf16 / fp32 if fp32 else 1.0)

def _itemsize(dtype: str) -> int:
    return int(getattr(torch, dtype).itemsize)

def _model_output(gm: fx.GraphModule, measured: dict[str, Measured]) -> Any:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    return measured[output.name].value

def _loss_cost(loss_fn: Any, spec: ModelSpec, outputs: list[Any], targets: list[Any]
               ) -> LossCost:
    """``loss_fn`` at each of MEASURED_BATCHES (saved, working and target bytes)."""
    try:
        at = [_loss_bytes(loss_fn, output, target)
              for output, target in zip(outputs, targets, strict=True)]
    except Exception as exc:  # a loss meta tensors cannot run (.item(), data-dependent ops)
        log.warning("%s: loss_fn could not run on meta tensors (%s: %s); its memory on the "
                    "last stage is not planned", spec.path, type(exc).__name__, exc)
        at = [(0, 0, nbytes(target)) for target in targets]
    saved, working, target_bytes = zip(*at, strict=True)
    return LossCost(_linear(*saved), _linear(*working), _linear(*target_bytes))

def _loss_bytes(loss_fn: Any, output: Any, target: Any) -> tuple[int, int, int]:
    """Run ``loss_fn`` on meta copies of the model's output (autograd leaves, as the last
    stage's output is to the loss) and catch what it saves besides its inputs. Its backward
    makes a gradient for the output and one for each saved value."""
    output = fx.node.map_aggregate(output, _meta_leaf)
    target = fx.node.map_aggregate(
        target, lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t)
    kept: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        kept.append(tensor)
        return tensor

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn(output, target)
    inputs = {storage_id(t) for t in flat_tensors((output, target))}
    own = {storage_id(t): int(t.untyped_storage().nbytes()) for t in kept
           if storage_id(t) not in inputs}
    saved = sum(own.values())
    return saved, saved + nbytes(output), nbytes(target)

def _meta_leaf(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return torch.empty_like(value, device="meta").requires_grad_()
    return value

def _value_spec(name: str, one: torch.Tensor, two: torch.Tensor,
                autocast_dtype: str) -> ValueSpec:
    dtype = str(one.dtype).removeprefix("torch.")
    return ValueSpec(name, tuple(one.shape), tuple(two.shape), dtype, bool(one.requires_grad),
                     autocast_dtype)

def _linear(at_low: float, at_high: float) -> Linear:
    """The line through the values measured at the two MEASURED_BATCHES."""
    low, high = MEASURED_BATCHES
    per_sample = (at_high - at_low) / (high - low)
    return Linear(fixed=at_low - per_sample * low, per_sample=per_sample)

def _sum_linear(items: Iterator[Linear] | Sequence[Linear]) -> Linear:
    fixed = per_sample = 0.0
    for item in items:
        fixed += item.fixed
        per_sample += item.per_sample
    return Linear(fixed, per_sample)

def _batch_norm_channels(gm: fx.GraphModule, n: fx.Node) -> int:
    """The channels of a BatchNorm module node (0 for any other node): what a synchronized
    BatchNorm all-reduces per micro-batch."""
    if n.op != "call_module":
        return 0
    module = gm.get_submodule(str(n.target))
    return int(module.num_features) if isinstance(module, nn.modules.batchnorm._BatchNorm) else 0

def _owner(n: fx.Node) -> str:
    if n.op == "call_module":
        return str(n.target)
    stack = n.meta.get("nn_module_stack")
    if not stack:
        return ""
    # {key: (qualified name, type)}; torch.export's keys are not the names ("L__self__gpt").
    key = next(reversed(stack))
    value = stack[key]
    if str(key).startswith("_empty_nn_module_stack"):  # torch.export: a node outside modules
        return ""
    return str(value[0]) if isinstance(value, tuple) and value else str(key)

def _node_cost(n: fx.Node, one: Measured, two: Measured,
               params: Sequence[torch.Tensor], buffer_bytes: int, shared_bytes: int) -> NodeCost:
    is_tensor = isinstance(one.value, torch.Tensor)
    return NodeCost(
        name=n.name, op=n.op, target=_target_name(n), module=_owner(n),
        shape=_shape_at_one(one.value, two.value) if is_tensor else (), is_tensor=is_tensor,
        fwd_flops=_linear(one.fwd_flops, two.fwd_flops),
        bwd_flops=_linear(one.bwd_flops, two.bwd_flops),
        output_bytes=_linear(nbytes(one.value), nbytes(two.value)),
        saved_bytes=_linear(one.saved_bytes, two.saved_bytes),
        params=sum(p.numel() for p in params),
        param_bytes=sum(nbytes(p) for p in params), param_tensors=len(params),
        buffer_bytes=buffer_bytes, shared_bytes=shared_bytes,
        autograd_nodes=one.autograd_nodes,
        kernels=tuple(zip(one.kernels, two.kernels, strict=True)),
        selective_bytes=_linear(one.selective_bytes, two.selective_bytes),
    )

def _shape_at_one(low: torch.Tensor, high: torch.Tensor) -> tuple[int, ...]:
    return ValueSpec("", tuple(low.shape), tuple(high.shape), "", False).shape_at(1)

def _target_name(n: fx.Node) -> str:
    target = n.target
    return target if isinstance(target, str) else getattr(target, "__name__", repr(target))

def _tensors_of(gm: fx.GraphModule, n: fx.Node) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(parameters, buffers) that node ``n`` reads directly."""
    if n.op == "call_module":
        module = gm.get_submodule(str(n.target))
        return list(module.parameters()), list(module.buffers())
    if n.op == "get_attr":
        value = _get_attr(gm, str(n.target))
        if isinstance(value, nn.Parameter):
            return [value], []
        if isinstance(value, nn.Module):
            return list(value.parameters()), list(value.buffers())
        return [], [value] if isinstance(value, torch.Tensor) else []
    return [], []

def _get_attr(gm: fx.GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value

def _first_users(gm: fx.GraphModule, compute: list[fx.Node]
                 ) -> tuple[dict[str, tuple[torch.Tensor, ...]], dict[str, int]]:
    """Attribute each parameter and buffer to the first compute node that uses it."""
    seen: set[int] = set()
    params: dict[str, tuple[torch.Tensor, ...]] = {}
    buffers: dict[str, int] = {}
    for n, reader in _readers(gm, compute):
        p_list, b_list = _tensors_of(gm, reader)
        new_params = tuple(p for p in p_list if id(p) not in seen)
        new_buffers = [b for b in b_list if id(b) not in seen]
        seen.update(id(t) for t in (*new_params, *new_buffers))
        params[n.name] = params.get(n.name, ()) + new_params
        buffers[n.name] = buffers.get(n.name, 0) + sum(nbytes(b) for b in new_buffers)
    return params, buffers

def _readers(gm: fx.GraphModule, compute: list[fx.Node]) -> Iterator[tuple[fx.Node, fx.Node]]:
    """(compute node, node whose parameters it reads): itself, or a get_attr it consumes."""
    for n in compute:
        yield n, n
        for arg in n.all_input_nodes:
            if arg.op == "get_attr":
                yield n, arg

def _input_bytes(gm: fx.GraphModule, one: dict[str, Measured],
                 two: dict[str, Measured]) -> dict[str, Linear]:
    return {n.name: _linear(nbytes(one[n.name].value), nbytes(two[n.name].value))
            for n in gm.graph.nodes if n.op == "placeholder"}

def _shared_bytes(gm: fx.GraphModule, compute: list[fx.Node]) -> dict[str, int]:
    """Per node, the bytes of the parameters whose last user it is, among those that an earlier
    node used first (shared modules, tied weights)."""
    users: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for n, reader in _readers(gm, compute):
        for p in _tensors_of(gm, reader)[0]:
            if n.name not in users.setdefault(id(p), []):
                users[id(p)].append(n.name)
            tensors[id(p)] = p
    shared: dict[str, int] = {}
    for key, names in users.items():
        if len(names) > 1:
            shared[names[-1]] = shared.get(names[-1], 0) + nbytes(tensors[key])
    return shared
