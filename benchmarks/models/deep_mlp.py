"""Sixteen equal layers and cheap boundaries: with few micro-batches per step, 1F1B on 2
devices idles a third of the step, and interleaving (two stages per device) halves that bubble
for one extra send per micro-batch. A model where interleaving should win."""

import torch
from torch import nn

WIDTH, LAYERS, CLASSES = 512, 16, 10


def build_model() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    layers.append(nn.Linear(WIDTH, CLASSES))
    return nn.Sequential(*layers)


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, WIDTH), torch.randint(0, CLASSES, (batch_size,))
