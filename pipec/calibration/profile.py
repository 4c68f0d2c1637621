"""`pipec profile`: measure a model on this machine's device and fit the time model's constants.

The model runs whole training passes (forward, then backward from the outputs) on real tensors
at several micro-batch sizes, so every node is timed in context: after the node before it, with
the caches and the allocator as a stage leaves them. A stamp after each node's forward and a
hook on each node's output gradient (autograd calls it when the node's backward starts) split the
pass into per-node forward and backward times; the median of ``repeats`` passes is kept.

The result serves twice. The profiled model's own per-node times (``Calibration.nodes``) are
used when that same graph is compiled. A non-negative least-squares fit of
``t = overhead + flops · s_flop + bytes · s_byte`` over all (node, micro-batch) points, one for
forward and one for backward, gives constants for any other model on the same device.
"""

from __future__ import annotations

import copy
import functools
import itertools
import logging
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import fx, nn

from pipec.calibration.heap import set_training_heap
from pipec.calibration.norm_times import kept_norm_timings
from pipec.calibration.probe import side_by_side
from pipec.calibration.split_backward_times import split_backward_timing
from pipec.calibration.step_times import data_seconds, loss_timing, optimizer_seconds
from pipec.cost.model import PRECISIONS, Calibration, Fit, NodeTiming
from pipec.errors import ConfigError
from pipec.frontend.annotate import COMPUTE_OPS, CostGraph, annotate
from pipec.frontend.loader import ModelSpec, load_model_file
from pipec.frontend.normalization import (
    NormRewrite,
    group_norm_rewrites,
    to_group_norm,
    with_functional_group_norms,
)
from pipec.frontend.tensors import flat_tensors
from pipec.frontend.trace import Traced, batch_inputs, model_loss, trace_model

log = logging.getLogger(__name__)

PROFILE_SIZES = (1, 2, 4, 8, 16, 32, 64)
PROFILE_NORMS = ("group", "keep")
MAX_REPEATS = 200  # however long min_seconds asks


@dataclass(frozen=True)
class Sample:
    """One node timed at one micro-batch size."""

    node: str
    micro_batch: int
    fwd_flops: float
    bwd_flops: float
    moved_bytes: float
    fwd_s: float
    bwd_s: float


def profile_model(model: Path, batch_size: int, device: str = "cpu", repeats: int = 10,
                  norm: str = "group", precision: str = "fp32", min_seconds: float = 0.0,
                  processes: int = 1, frontend: str = "auto"
                  ) -> tuple[Calibration, tuple[Sample, ...]]:
    """Time ``model`` at micro-batch sizes 1, 2, 4, … up to ``batch_size``. ``norm``: "group"
    times each BatchNorm as the GroupNorm a pipelined plan runs (`--norm auto`), "keep" as is;
    ``precision`` "bf16": the forward runs under bf16 autocast, as train.py runs it. At least
    ``repeats`` passes per size, and more until ``min_seconds`` have passed: a machine whose
    speed drifts by the second (a shared or virtual one) is averaged over that time. With
    ``processes`` > 1, how much slower a pass runs with that many side by side (this machine's
    processes share it) is measured too (`Calibration.contention`)."""
    target = _device(device)
    if target.type == "cpu":
        set_training_heap()  # the heap as train.py trains (pipec.calibration.heap)
    if norm not in PROFILE_NORMS:
        raise ConfigError(f"--norm {norm!r}: use group (as pipelined plans run) or keep")
    spec = load_model_file(model)
    traced = trace_model(spec, frontend, target.type)
    graph = annotate(traced, spec, bf16_memory=False)
    real = _with_real_tensors(traced, spec, target)
    sizes = profile_sizes(batch_size)
    kept_norm: tuple[NodeTiming, ...] = ()
    if norm == "group":
        rewrites = group_norm_rewrites(traced, graph)
        _to_group_norms(real, rewrites)
        real = with_functional_group_norms(real, rewrites)
        # A data-parallel plan keeps BatchNorm: what it pays beyond the GroupNorm timed here.
        kept_norm = kept_norm_timings(graph, rewrites, sizes, target, repeats)
    real = real.to(target).train()
    batches = {size: batch_inputs(spec, size) for size in sizes}
    inputs = {size: tuple(t.to(target) for t in batch[0]) for size, batch in batches.items()}
    if precision not in PRECISIONS:
        raise ConfigError(f"--precision {precision!r}: use fp32 or bf16")
    seconds, overhead = _time_in_context(real, inputs, repeats, target, precision == "bf16",
                                         min_seconds)
    samples = [sample for size in sizes for sample in _samples(graph, size, seconds[size])]
    forward, backward = fit_samples(samples)
    middle = sizes[len(sizes) // 2]
    contention = side_by_side(lambda: _one_pass(real, inputs[middle], target), processes)
    loss = loss_timing(real, inputs, {size: b[1] for size, b in batches.items()},
                       model_loss(spec, traced), target, repeats)
    return (Calibration(target.type, forward, backward, _timings(graph, samples), overhead,
                        contention=contention, data_s=data_seconds(spec, sizes), loss=loss,
                        kept_norm=kept_norm,
                        split_backward=split_backward_timing(real, inputs, target),
                        optimizer_s=optimizer_seconds(real)),
            tuple(samples))


def profile_sizes(batch_size: int) -> list[int]:
    """The micro-batch sizes a profile times up to ``batch_size``: 1, 2, 4, …"""
    return [s for s in PROFILE_SIZES if s <= batch_size] or [batch_size]


class _Autocast(nn.Module):
    """``module`` with its forward under bf16 autocast, as train.py runs it under
    ``--precision bf16``."""

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        super().__init__()
        self.module, self.device_type = module, device.type

    def forward(self, *inputs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=torch.bfloat16):
            return self.module(*inputs)


def _with_real_tensors(traced: Traced, spec: ModelSpec, device: torch.device
                       ) -> fx.GraphModule:
    """A copy of the traced graph (either front end's) holding the model's weights and
    buffers as ``build_model`` makes them under seed 0, found by name, and the constants the
    trace made (an exported graph's) with their values (zeros where unknown: they time the
    same). Tensors the graph makes on the trace's meta device are made on ``device``."""
    torch.manual_seed(0)
    model = spec.build_model()
    named = {**dict(model.named_parameters(remove_duplicate=False)),
             **dict(model.named_buffers(remove_duplicate=False)), **dict(traced.constants)}
    with warnings.catch_warnings():  # copying an exported graph's pytree specs warns
        warnings.simplefilter("ignore", FutureWarning)
        real = copy.deepcopy(traced.graph_module)
    for prefix, module in real.named_modules():
        for slot in ("_parameters", "_buffers"):
            tensors = getattr(module, slot)
            for name, tensor in tensors.items():
                if tensor is not None:
                    tensors[name] = named.get(f"{prefix}.{name}".lstrip("."), _zeros(tensor))
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor):
                setattr(module, name, named.get(f"{prefix}.{name}".lstrip("."), _zeros(value)))
    # An exported graph's code takes and returns pytrees; this one is called with the inputs.
    real.graph.set_codegen(fx.graph.CodeGen())
    on_device = functools.partial(_meta_to, device)
    for node in real.graph.nodes:
        node.args = fx.node.map_aggregate(node.args, on_device)
        node.kwargs = fx.node.map_aggregate(node.kwargs, on_device)
    real.recompile()
    return real


def _meta_to(device: torch.device, arg: Any) -> Any:
    return device if isinstance(arg, torch.device) and arg.type == "meta" else arg


def _zeros(meta: torch.Tensor) -> torch.Tensor:
    zeros = torch.zeros(meta.shape, dtype=meta.dtype)
    return nn.Parameter(zeros, meta.requires_grad) if isinstance(meta, nn.Parameter) else zeros


def _to_group_norms(real: fx.GraphModule, rewrites: tuple[NormRewrite, ...]) -> None:
    """Swap each BatchNorm for the GroupNorm `--norm auto` gives a pipelined plan, built as the
    emitted stages build it."""
    for rewrite in (r for r in rewrites if not r.node):
        assert rewrite.groups is not None  # a GroupNorm rewrite always has its group count
        parent, _, name = rewrite.module.rpartition(".")
        setattr(real.get_submodule(parent), name,
                to_group_norm(real.get_submodule(rewrite.module), rewrite.groups))


def _device(name: str) -> torch.device:
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"--device {name!r}: use cpu or cuda")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible here; use --device cpu")
    return torch.device(name)


class _Clock:
    """The timestamps of one training pass: after each node's forward, and when each node's
    output gradient is complete, that is, when its backward starts."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.forward: list[tuple[float, float]] = []  # (node ended, stamp done)
        self.backward: list[tuple[int, float]] = []

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def stamp(self, value: Any, index: int) -> Any:
        """Record the end of node ``index``'s forward; the time this takes (registering the
        hooks) is left out of the next node's, which starts counting when it returns."""
        ended = self.now()
        for tensor in flat_tensors(value):
            if tensor.requires_grad:
                tensor.register_hook(lambda _, i=index: self.backward.append((i, self.now())))
        self.forward.append((ended, self.now()))
        return value


_CLOCK: list[_Clock] = []  # the clock of the pass in progress


def _stamp(value: Any, index: int) -> Any:
    """Called by the instrumented graph after compute node ``index``."""
    return _CLOCK[-1].stamp(value, index)


@contextmanager
def _running(clock: _Clock) -> Iterator[None]:
    _CLOCK.append(clock)
    try:
        yield
    finally:
        _CLOCK.pop()


def _instrumented(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` (sharing its modules) with a `_stamp` after every compute node."""
    graph = fx.Graph()
    values: dict[fx.Node, fx.Node] = {}
    index = 0
    for node in gm.graph.nodes:
        values[node] = graph.node_copy(node, lambda n: values[n])
        if node.op in COMPUTE_OPS:
            values[node] = graph.call_function(_stamp, (values[node], index))
            index += 1
    return fx.GraphModule(gm, graph)


def _time_in_context(gm: fx.GraphModule, inputs: dict[int, tuple[torch.Tensor, ...]],
                     repeats: int, device: torch.device, bf16: bool = False,
                     min_seconds: float = 0.0
                     ) -> tuple[dict[int, np.ndarray], tuple[float, float]]:
    """Seconds of every compute node in a training pass at each micro-batch size, shape
    (2, nodes), forward then backward, the median of ``repeats`` passes after a warm-up; and
    the fixed cost of one pass (forward, backward), which each stage pays once.

    The sizes take turns, so that a machine whose speed drifts (a shared or virtual one) drifts
    under all of them alike. The stamps and hooks cost time of their own (a few microseconds
    per node, more than a small node's work on a CPU): plain passes, alternated with the
    instrumented ones, give the real forward and backward totals; less the fixed cost, the
    difference is taken off the nodes evenly.
    """
    instrumented: nn.Module = _instrumented(gm)
    plain: nn.Module = gm
    trivial: nn.Module = _Trivial().to(device)
    if bf16:
        instrumented, plain, trivial = (_Autocast(m, device) for m in (instrumented, gm, trivial))
    nodes = sum(n.op in COMPUTE_OPS for n in gm.graph.nodes)
    timed: dict[int, list[np.ndarray]] = {size: [] for size in inputs}
    totals: dict[int, list[np.ndarray]] = {size: [] for size in inputs}
    fixed: list[np.ndarray] = []
    started = time.perf_counter()
    for repeat in itertools.count():
        if repeat > repeats and (time.perf_counter() - started >= min_seconds
                                 or repeat > MAX_REPEATS):
            break
        for size, batch in inputs.items():
            timed[size].append(_per_node(instrumented, batch, nodes, device))
            totals[size].append(_totals(plain, batch, device))
            fixed.append(_totals(trivial, (torch.ones(1, device=device),), device))
        log.info("profiled pass %d (at least %d, and %.0f s) at micro-batch sizes %s", repeat,
                 repeats, min_seconds, ", ".join(map(str, inputs)))
    overhead = np.median(fixed[len(inputs):], axis=0)
    seconds = {size: _corrected(np.median(timed[size][1:], axis=0),
                                np.median(totals[size][1:], axis=0) - overhead)
               for size in inputs}
    return seconds, (float(overhead[0]), float(overhead[1]))


class _Trivial(nn.Module):
    """A stage with next to no work: timing it gives the fixed cost of a pass."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def _corrected(per_node: np.ndarray, totals: np.ndarray) -> np.ndarray:
    return np.stack([_even_correction(per_node[k], float(totals[k])) for k in range(2)])


def _even_correction(seconds: np.ndarray, total: float) -> np.ndarray:
    """``seconds`` shifted by the same amount per timed node (never below zero) to sum to
    ``total``."""
    timed = seconds > 0
    if not timed.any():
        return seconds
    shift = (total - seconds.sum()) / timed.sum()
    return np.where(timed, np.maximum(seconds + shift, 0.0), 0.0)


def _one_pass(gm: nn.Module, inputs: tuple[torch.Tensor, ...], device: torch.device
              ) -> tuple[_Clock, float, float, float]:
    """One forward and backward of ``gm``: its clock, and when it started, when its backward
    started and when it ended."""
    clock = _Clock(device)
    with _running(clock):
        started = clock.now()
        outputs = [t for t in flat_tensors(gm(*inputs)) if t.requires_grad]
        backward_started = clock.now()
        if outputs:
            torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
        ended = clock.now()
    gm.zero_grad(set_to_none=True)
    return clock, started, backward_started, ended


def _totals(gm: nn.Module, inputs: tuple[torch.Tensor, ...], device: torch.device
            ) -> np.ndarray:
    """Seconds of one pass's forward and of its backward, shape (2,)."""
    _, started, backward_started, ended = _one_pass(gm, inputs, device)
    return np.array([backward_started - started, ended - backward_started])


def _per_node(gm: nn.Module, inputs: tuple[torch.Tensor, ...], nodes: int,
              device: torch.device) -> np.ndarray:
    """Seconds of each node of an instrumented graph in one pass, shape (2, nodes)."""
    clock, started, _, ended = _one_pass(gm, inputs, device)
    # The nodes run in graph order, once each: a node's forward runs from the previous stamp's
    # return to its own stamp.
    starts = [started, *(done for _, done in clock.forward[:-1])]
    forward = np.array([done - start for (done, _), start in zip(clock.forward, starts,
                                                                   strict=True)])
    return np.stack([forward, _backward_seconds(clock.backward, ended, nodes)])


def _backward_seconds(ready: list[tuple[int, float]], ended: float, nodes: int) -> np.ndarray:
    """Each interval between gradient-ready events goes to the node whose event opens it:
    autograd's engine runs that node's backward next (it runs the latest-created ready
    function first, and a node's own functions were created together)."""
    seconds = np.zeros(nodes)
    for (index, at), (_, following) in zip(ready, [*ready[1:], (-1, ended)], strict=True):
        seconds[index] += following - at
    return seconds


def _samples(graph: CostGraph, size: int, seconds: np.ndarray) -> list[Sample]:
    return [Sample(n.name, size, n.fwd_flops.at(size), n.bwd_flops.at(size),
                   n.output_bytes.at(size) + n.param_bytes, float(seconds[0, i]),
                   float(seconds[1, i])) for i, n in enumerate(graph.nodes)]


def _timings(graph: CostGraph, samples: list[Sample]) -> tuple[NodeTiming, ...]:
    by_node: dict[str, list[Sample]] = {}
    for sample in samples:
        by_node.setdefault(sample.node, []).append(sample)
    return tuple(NodeTiming(n.name, n.target, tuple(s.micro_batch for s in by_node[n.name]),
                            tuple(s.fwd_s for s in by_node[n.name]),
                            tuple(s.bwd_s for s in by_node[n.name])) for n in graph.nodes)


def fit_samples(samples: Sequence[Sample]) -> tuple[Fit, Fit]:
    """The forward and the backward time model that best explain ``samples``:
    ``t = overhead + flops · s_flop + bytes · s_byte``, each coefficient non-negative."""
    return (_fit([(s.fwd_flops, s.moved_bytes) for s in samples], [s.fwd_s for s in samples]),
            _fit([(s.bwd_flops, s.moved_bytes) for s in samples], [s.bwd_s for s in samples]))


def _fit(features: list[tuple[float, float]], seconds: list[float]) -> Fit:
    """Non-negative least squares over [1, flops, bytes]: the best of the feature subsets whose
    unconstrained fit is non-negative (three features: exact and cheap)."""
    x = np.column_stack([np.ones(len(features)), np.array(features, dtype=float)])
    y = np.array(seconds)
    best: tuple[float, np.ndarray] | None = None
    for k in range(1, 4):
        for subset in itertools.combinations(range(3), k):
            coefficients = np.zeros(3)
            coefficients[list(subset)] = np.linalg.lstsq(x[:, subset], y, rcond=None)[0]
            if (coefficients >= 0).all():
                residual = float(np.sum((x @ coefficients - y) ** 2))
                if best is None or residual < best[0]:
                    best = (residual, coefficients)
    if best is None:
        return Fit(float(np.mean(y)), 0.0, 0.0)
    return Fit(*map(float, best[1]))


def measured_saved_bytes(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> int:
    """Bytes autograd really saves for backward in one forward of ``model`` (each storage
    once, parameters and buffers excluded): what `annotate` predicts on meta tensors."""
    static = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in static:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*inputs)
    return sum(seen.values())
