"""A residual MLP over 7 tokens: its regions shard over 2 ranks, its sequence does not."""

import torch
from torch import nn


class OddSequence(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(12)
        self.mlp = nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 12))
        self.out = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mlp(self.norm(x))
        return self.out(x.mean(dim=1))


def build_model() -> nn.Module:
    return OddSequence()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 7, 12), torch.randint(0, 3, (batch_size,))
