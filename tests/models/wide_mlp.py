"""An MLP whose weights outweigh its activations (eight 1024-wide layers, 4 MiB each): a rank
that built the whole model would measure the other stages' weights on top of its own."""

import torch
from torch import nn

WIDTH, LAYERS, CLASSES = 1024, 8, 10


def build_model() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, CLASSES))


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, WIDTH), torch.randint(0, CLASSES, (batch_size,))
