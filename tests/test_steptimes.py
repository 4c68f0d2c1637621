"""pipec.steptimes: the loss and the data a step runs besides the model's nodes, timed."""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from pipec.steptimes import data_seconds, loss_timing


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
