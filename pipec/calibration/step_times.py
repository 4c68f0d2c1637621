"""What a training step runs besides the model's nodes, timed for `pipec profile` and the
measured-by-default compile: the model file's loss on the model's real output (the last stage
runs it after its nodes), its sample_batch (train.py makes each step's data with it), and the
optimizer's step over the model's parameters."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from torch import fx, nn

from pipec.calibration.timers import device_now
from pipec.cost.model import NodeTiming
from pipec.frontend.loader import ModelSpec


def loss_timing(gm: nn.Module, inputs: dict[int, tuple[torch.Tensor, ...]],
                targets: dict[int, Any], loss_fn: Any, device: torch.device, repeats: int
                ) -> NodeTiming:
    """The model file's loss, forward and backward, on the model's real output at each size:
    what train.py's last stage runs after its nodes (the median of ``repeats`` + 1 runs)."""
    fwd, bwd = [], []
    for size, batch in inputs.items():
        with torch.no_grad():
            output = fx.node.map_aggregate(gm(*batch), _leaf)
        target = fx.node.map_aggregate(targets[size], _to(device))
        times = np.array([_loss_pass(loss_fn, output, target, device)
                          for _ in range(repeats + 1)])[1:]
        fwd.append(float(np.median(times[:, 0])))
        bwd.append(float(np.median(times[:, 1])))
    return NodeTiming("loss", "loss_fn", tuple(inputs), tuple(fwd), tuple(bwd))


def _leaf(value: Any) -> Any:
    return value.detach().requires_grad_(value.is_floating_point()) if isinstance(
        value, torch.Tensor) else value


def _to(device: torch.device) -> Any:
    return lambda value: value.to(device) if isinstance(value, torch.Tensor) else value


def _loss_pass(loss_fn: Any, output: Any, target: Any, device: torch.device
               ) -> tuple[float, float]:
    started = device_now(device)
    loss = loss_fn(output, target)
    backward_started = device_now(device)
    loss.backward()
    return backward_started - started, device_now(device) - backward_started



def data_seconds(spec: ModelSpec, sizes: list[int]) -> tuple[float, float]:
    """What train.py's synthetic data costs: sample_batch timed at each size (the median of 5)
    as train.py calls it, the CPU's generator seeded for the step inside a forked random state
    (the MLP sample's batch of 64: 0.04 ms on a 2-core AMD EPYC VM), fitted as fixed seconds
    + seconds per sample. A model file with train_dataset() reads its own data, which is not
    timed: (0, 0)."""
    if spec.has_train_dataset:
        return (0.0, 0.0)
    seconds = []
    for size in sizes:
        trials = []
        for step in range(5):
            started = time.perf_counter()
            with torch.random.fork_rng(devices=[]):
                torch.default_generator.manual_seed(step)
                spec.sample_batch(size)
            trials.append(time.perf_counter() - started)
        seconds.append(float(np.median(trials)))
    if len(sizes) == 1:
        return (0.0, seconds[0] / sizes[0])
    per_sample, fixed = np.polyfit(sizes, seconds, 1)
    return (max(float(fixed), 0.0), max(float(per_sample), 0.0))


# train.py's optimizers as it builds them: momentum SGD, and AdamW fused on CUDA.
OPTIMIZERS = {"sgd": lambda ps: torch.optim.SGD(ps, lr=1e-9, momentum=0.9),
              "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-9, fused=ps[0].is_cuda)}
# Tensors of a few values each: what the optimizer pays per tensor, its bytes next to nothing.
FEW_TENSORS, MANY_TENSORS, TINY = 4, 64, 16
# Written between two timed steps on a CPU, as the backward does: the optimizer meets its
# weights, gradients and state out of the caches (the MLP sample's half, 0.59 MB: 0.22 ms with
# them cached, 0.34 ms after 64 MiB written, on a 2-core AMD EPYC VM).
EVICT_BYTES = 64 * 2**20
# The largest set of the model's weights timed: the optimizer's state is made for a copy of them
# (AdamW: 4 × their bytes); a model with none this small is timed on 4 tensors of 16 MiB.
LARGEST_TIMED_BYTES = 256 * 2**20


def optimizer_seconds(model: nn.Module) -> tuple[tuple[str, float, float, float], ...]:
    """Per optimizer of train.py, its step as train.py runs it (the step, the learning rate's
    scheduler, zero_grad) as fixed seconds + seconds per parameter tensor + seconds per
    parameter byte, the caches emptied before each step: least squares on relative errors over
    FEW_TENSORS and MANY_TENSORS tiny tensors and ``model``'s parameters whole, in halves and
    in quarters (contiguous, as stages hold them), those of LARGEST_TIMED_BYTES at most."""
    params = [p.detach() for p in model.parameters() if p.requires_grad]
    device = params[0].device if params else torch.device("cpu")
    tiny = [torch.zeros(TINY, device=device) for _ in range(MANY_TENSORS)]
    evict = torch.empty(EVICT_BYTES // 4) if device.type == "cpu" else None
    parts = [p for p in _parts(params) if _bytes(p) <= LARGEST_TIMED_BYTES] or [
        [torch.zeros(4 * 2**20, device=device) for _ in range(4)]]
    sets = [tiny[:FEW_TENSORS], tiny, *parts]
    counts = np.array([[1.0, len(tensors), _bytes(tensors)] for tensors in sets])
    return tuple((name, *_nonnegative_fit(counts, np.array([_step_s(make, t, device, evict)
                                                             for t in sets])))
                 for name, make in OPTIMIZERS.items())


def _nonnegative_fit(counts: np.ndarray, seconds: np.ndarray) -> tuple[float, float, float]:
    """seconds ≈ counts @ (fixed, per tensor, per byte), least squares on relative errors;
    a coefficient the fit makes negative is 0 and the others fitted again."""
    kept = list(range(counts.shape[1]))
    while True:
        design = counts[:, kept] / seconds[:, None]
        solution, *_ = np.linalg.lstsq(design, np.ones_like(seconds), rcond=None)
        if (solution >= 0).all() or len(kept) == 1:
            break
        kept.pop(int(np.argmin(solution)))
    coefficients = np.zeros(counts.shape[1])
    coefficients[kept] = np.maximum(solution, 0.0)
    return float(coefficients[0]), float(coefficients[1]), float(coefficients[2])


def _parts(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``params`` whole, in halves and in quarters: the distinct non-empty ones."""
    spans = dict.fromkeys((i * len(params) // pieces, (i + 1) * len(params) // pieces)
                          for pieces in (1, 2, 4) for i in range(pieces))
    return [params[a:b] for a, b in spans if b > a]


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _step_s(make: Any, tensors: list[torch.Tensor], device: torch.device,
            evict: torch.Tensor | None) -> float:
    """The median of 5 optimizer steps over copies of ``tensors`` (after 2 that make its
    state), each with train.py's scheduler step and zero_grad, gradients set beforehand and
    ``evict`` written over before each."""
    leaves = [t.clone().requires_grad_() for t in tensors]
    grads = [torch.ones_like(t) for t in leaves]
    optimizer = make(leaves)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    times: list[float] = []
    for _ in range(7):
        for leaf, grad in zip(leaves, grads, strict=True):
            leaf.grad = grad
        if evict is not None:
            evict.fill_(len(times))
        started = device_now(device)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(device_now(device) - started)
    return float(np.median(times[2:]))
