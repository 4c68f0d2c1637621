"""A model whose layer count, parameter count and compute disagree: convolutions at full
resolution hold almost all the compute and few weights, one wide linear layer holds most of the
weights, and a stack of small layers holds most of the layers. Balancing layers (Megatron's
uniform split) or parameters (DeepSpeed's default) leaves one stage with nearly all the work;
balancing time does not. benchmarks/measured_gain.py measures it."""

import torch
from torch import nn

SIZE, CHANNELS, CONVOLUTIONS, WIDE, NARROW, SMALL_LAYERS, CLASSES = 32, 32, 4, 1024, 64, 16, 10


def build_model() -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(3, CHANNELS, 3, padding=1), nn.ReLU()]
    for _ in range(CONVOLUTIONS):
        layers += [nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1), nn.ReLU()]
    layers += [
        nn.AdaptiveAvgPool2d(8), nn.Flatten(),
        nn.Linear(CHANNELS * 64, WIDE), nn.ReLU(),
        nn.Linear(WIDE, NARROW), nn.ReLU(),
    ]
    for _ in range(SMALL_LAYERS):
        layers += [nn.Linear(NARROW, NARROW), nn.ReLU()]
    layers.append(nn.Linear(NARROW, CLASSES))
    return nn.Sequential(*layers)


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(batch_size, 3, SIZE, SIZE),
            torch.randint(0, CLASSES, (batch_size,)))
