"""Layers that add a learned bias made from positions alone, as T5's relative position bias: it
is made after the second layer and added by the later ones. A stage that makes it sends the
next stage a tensor that depends on its weights but on none of its inputs."""

import torch
from torch import nn

WIDTH, CONTEXT, LAYERS = 16, 8, 6


class PositionBiasNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
        self.position_bias = nn.Embedding(CONTEXT, WIDTH)
        self.head = nn.Linear(WIDTH, 3)
        self.register_buffer("positions", torch.arange(CONTEXT), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.layers[1](torch.relu(self.layers[0](x))))
        bias = self.position_bias(self.positions)
        for layer in self.layers[2:]:
            h = torch.relu(layer(h) + bias)
        return self.head(h.mean(1))


def build_model() -> nn.Module:
    return PositionBiasNet()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, CONTEXT, WIDTH), torch.randint(0, 3, (batch_size,))


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, targets)
