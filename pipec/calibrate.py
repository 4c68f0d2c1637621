"""`pipec profile`: measure a model on this machine's device and fit the time model's constants.

Every compute node runs on real tensors, isolated as `annotate` isolates it (its inputs as fresh
leaves), at several micro-batch sizes: its forward, then forward and backward, each a warm-up and
then the fastest of ``repeats`` runs. A non-negative least-squares fit of
``t = overhead + flops · s_flop + bytes · s_byte`` over all (node, micro-batch) points, one fit
for forward and one for backward, gives a Calibration that `pipec compile --calibration` uses
in place of the preset's roofline.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import fx

from pipec.annotate import COMPUTE_OPS, MEASURED_BATCHES, CostGraph, annotate
from pipec.costmodel import Calibration, Fit
from pipec.errors import ConfigError, TraceError
from pipec.loader import load_model_file
from pipec.trace import batch_inputs, trace_model

log = logging.getLogger(__name__)

PROFILE_SIZES = (1, 2, 4, 8, 16, 32, 64)


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


def profile_model(model: Path, batch_size: int, device: str = "cpu",
                  repeats: int = 5) -> tuple[Calibration, tuple[Sample, ...]]:
    target = _device(device)
    spec = load_model_file(model)
    try:
        traced = trace_model(spec, "fx")
    except TraceError as exc:
        message = str(exc).removesuffix("; try --frontend export")
        raise TraceError(f"{message}; pipec profile times the torch.fx graph, so it needs a model "
                         "fx can trace: compile this one without --calibration") from None
    graph = annotate(traced, [batch_inputs(spec, size)[0] for size in MEASURED_BATCHES])
    torch.manual_seed(0)
    real = fx.symbolic_trace(spec.build_model()).to(target).train()
    samples: list[Sample] = []
    engine_s = _backward_call_s(repeats, target)
    for size in [s for s in PROFILE_SIZES if s <= batch_size] or [batch_size]:
        samples += _time_nodes(real, graph, _inputs(spec, size, target), size, repeats,
                               target, engine_s)
        log.info("profiled micro-batch %d", size)
    forward = _fit([(s.fwd_flops, s.moved_bytes) for s in samples], [s.fwd_s for s in samples])
    backward = _fit([(s.bwd_flops, s.moved_bytes) for s in samples], [s.bwd_s for s in samples])
    return Calibration(target.type, forward, backward), tuple(samples)


def _inputs(spec: Any, size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(device) for t in batch_inputs(spec, size)[0])


def _device(name: str) -> torch.device:
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"--device {name!r}: use cpu or cuda")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible here; use --device cpu")
    return torch.device(name)


def _backward_call_s(repeats: int, device: torch.device) -> float:
    """The fixed cost of one `backward()` call (starting autograd's engine). Timing a node
    alone pays it once per node; a training step pays it once per stage, so it is taken off."""
    def prepare() -> Any:
        return ((torch.ones(1, device=device, requires_grad=True),), {})
    forward, both = _timers(lambda x: x * 1)
    return max(_fastest_s(prepare, both, repeats * 4, device)
               - _fastest_s(prepare, forward, repeats * 4, device), 0.0)


def _time_nodes(gm: fx.GraphModule, graph: CostGraph, inputs: tuple[torch.Tensor, ...],
                size: int, repeats: int, device: torch.device,
                engine_s: float) -> list[Sample]:
    env = _values(gm, inputs)
    grads = {v.name: v.requires_grad for v in graph.values}
    costs = {n.name: n for n in graph.nodes}
    samples = []
    for n in (n for n in gm.graph.nodes if n.op in COMPUTE_OPS):
        call = _callable(gm, n)
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: env[a.name])
        forward_s, both_s = _time_node(call, args, kwargs, grads, n, repeats, device)
        cost = costs[n.name]
        samples.append(Sample(n.name, size, cost.fwd_flops.at(size), cost.bwd_flops.at(size),
                              cost.output_bytes.at(size) + cost.param_bytes, forward_s,
                              max(both_s - forward_s - engine_s, 0.0)))
    return samples


def _values(gm: fx.GraphModule, inputs: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    """Every node's value on real data (no autograd)."""
    values: dict[str, Any] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            values[n.name] = super().run_node(n)
            return values[n.name]

    with torch.no_grad():
        Recorder(gm).run(*inputs)
    return values


def _callable(gm: fx.GraphModule, n: fx.Node) -> Callable[..., Any]:
    if n.op == "call_module":
        return gm.get_submodule(str(n.target))  # type: ignore[no-any-return]
    if n.op == "call_method":
        return lambda self, *args, **kwargs: getattr(self, str(n.target))(*args, **kwargs)
    return n.target  # type: ignore[return-value, no-any-return]


def _time_node(call: Callable[..., Any], args: Any, kwargs: Any, grads: dict[str, bool],
               n: fx.Node, repeats: int, device: torch.device) -> tuple[float, float]:
    """Seconds of the node's forward, and of its forward and backward (fastest runs)."""
    producers = [a.name for a in n.all_input_nodes]

    needs_grad = any(grads.get(p, False) for p in producers)

    def leaves() -> Any:
        """Fresh copies of the inputs (in-place ops must not touch the recorded values)."""
        def leaf(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                return value.detach().clone().requires_grad_(needs_grad)
            return value
        return fx.node.map_aggregate((args, kwargs), leaf)

    forward, both = _timers(call)
    return (_fastest_s(leaves, forward, repeats, device),
            _fastest_s(leaves, both, repeats, device))


def _timers(call: Callable[..., Any]) -> tuple[Callable[[Any], None], Callable[[Any], None]]:
    """Run ``call`` on prepared (args, kwargs): forward alone (recording autograd, as in
    training), and forward then backward."""
    def forward(prepared: Any) -> None:
        call(*prepared[0], **prepared[1])

    def both(prepared: Any) -> None:
        outputs = [t for t in _flat(call(*prepared[0], **prepared[1])) if t.requires_grad]
        if outputs:
            torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])

    return forward, both


def _flat(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [t for v in value for t in _flat(v)]
    return []


def _fastest_s(prepare: Callable[[], Any], run: Callable[[Any], None], repeats: int,
               device: torch.device) -> float:
    """Fastest of ``repeats`` runs of ``run`` after a warm-up; ``prepare`` is not timed.

    The fastest, not the median: on a shared machine interference only adds time, and the
    time a workload takes undisturbed is what the model predicts.
    """
    run(prepare())
    times = []
    for _ in range(repeats):
        prepared = prepare()
        _sync(device)
        started = time.perf_counter()
        run(prepared)
        _sync(device)
        times.append(time.perf_counter() - started)
    return min(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def save_calibration(calibration: Calibration, path: Path) -> None:
    path.write_text(json.dumps(asdict(calibration), indent=2, sort_keys=True) + "\n")


def load_calibration(path: Path) -> Calibration:
    try:
        data = json.loads(path.read_text())
        return Calibration(str(data["device"]), Fit(**data["forward"]), Fit(**data["backward"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"calibration file {path}: {exc}; make one with pipec profile") from None
