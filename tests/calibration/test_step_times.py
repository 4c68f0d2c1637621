"""pipec.calibration.step_times: the loss, the data and the optimizer step a step runs besides
the model's nodes, timed."""

from __future__ import annotations

import types
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pipec.calibration.step_times import (
    _nonnegative_fit,
    data_seconds,
    loss_timing,
    optimizer_seconds,
)
from pipec.cost.hardware import PRESETS
from pipec.cost.model import Calibration, Fit, optimizer_s


def test_the_loss_is_timed_at_each_size_on_the_models_output() -> None:
    model = nn.Linear(8, 512)
    inputs = {size: (torch.randn(size, 8),) for size in (1, 4, 16)}
    targets = {size: torch.randint(0, 512, (size,)) for size in inputs}
    timing = loss_timing(model, inputs, targets, F.cross_entropy, torch.device("cpu"), 3)
    assert timing.node == "loss" and timing.sizes == (1, 4, 16)
    assert all(t > 0 for t in (*timing.fwd_s, *timing.bwd_s))
    assert model.weight.grad is None  # the model's own backward is not run


def _spec(**functions: Any) -> Any:
    module = types.SimpleNamespace(**functions)
    return types.SimpleNamespace(module=module, sample_batch=functions["sample_batch"],
                                 has_train_dataset="train_dataset" in functions)


def test_the_data_is_timed_as_fixed_plus_per_sample_seconds() -> None:
    spec = _spec(sample_batch=lambda n: (torch.randn(n, 4096), torch.zeros(n)))
    fixed, per_sample = data_seconds(spec, [1, 8, 64])
    assert fixed >= 0 and per_sample >= 0 and fixed + 64 * per_sample > 0


def test_a_model_with_its_own_dataset_is_not_timed() -> None:
    spec = _spec(sample_batch=lambda n: (torch.randn(n, 4), torch.zeros(n)),
                 train_dataset=lambda: [])
    assert data_seconds(spec, [1, 2]) == (0.0, 0.0)


def test_the_optimizer_is_timed_for_each_of_train_pys_optimizers() -> None:
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    figures = optimizer_seconds(model)
    assert [name for name, *_ in figures] == ["sgd", "adamw"]
    for _, fixed, per_tensor, per_byte in figures:
        assert min(fixed, per_tensor, per_byte) >= 0
        assert fixed + 4 * per_tensor + per_byte * 4 * (64 * 256 + 256 + 256 * 10 + 10) > 0


def test_the_optimizers_fit_recovers_its_terms_and_keeps_them_non_negative() -> None:
    counts = np.array([[1.0, 4, 256], [1, 64, 4096], [1, 12, 4e6], [1, 6, 2e6]])
    exact = counts @ np.array([2e-4, 1e-5, 3e-10])
    assert _nonnegative_fit(counts, exact) == pytest.approx((2e-4, 1e-5, 3e-10))
    # Times that fall with the tensors: no negative time per tensor, the rest refitted.
    falling = counts @ np.array([1e-3, -1e-6, 3e-10])
    fixed, per_tensor, per_byte = _nonnegative_fit(counts, falling)
    assert per_tensor == 0 and fixed > 0 and per_byte > 0


def test_a_measured_optimizer_step_replaces_the_roofline_and_nothing_costs_nothing() -> None:
    cpu = PRESETS["cpu"]
    timed = Calibration("cpu", Fit(0, 0, 0), Fit(0, 0, 0),
                        optimizer_s=(("sgd", 2e-4, 1e-5, 3e-10),))
    assert optimizer_s(1e6, "sgd", cpu, 12, timed) == pytest.approx(2e-4 + 12e-5 + 3e-4)
    assert optimizer_s(1e6, "adamw", cpu, 12, timed) == optimizer_s(1e6, "adamw", cpu)
    assert optimizer_s(1e6, "sgd", cpu) == pytest.approx(1e6 * 5 / cpu.memory_bandwidth)
    assert optimizer_s(0.0, "sgd", cpu, 0, timed) == 0.0
