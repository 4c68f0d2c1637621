"""A multi-layer perceptron: the simplest model pipec plans (no batch-dependent layers)."""

import torch
from torch import nn

FEATURES, HIDDEN, CLASSES, LAYERS = 64, 256, 10, 6


def build_model() -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(FEATURES, HIDDEN), nn.ReLU()]
    for _ in range(LAYERS - 2):
        layers += [nn.Linear(HIDDEN, HIDDEN), nn.ReLU()]
    layers.append(nn.Linear(HIDDEN, CLASSES))
    return nn.Sequential(*layers)


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, FEATURES), torch.randint(0, CLASSES, (batch_size,))
