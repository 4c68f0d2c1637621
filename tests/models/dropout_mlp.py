"""An MLP with dropout: its training draws random numbers, so resuming must restore them."""

import torch
from torch import nn


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 64),
                         nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 10))


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 32), torch.randint(0, 10, (batch_size,))
