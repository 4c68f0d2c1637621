"""A model that ignores its second input: the first stage must still accept it."""

import torch
from torch import nn


class IgnoresMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 8)
        self.middle = nn.Linear(8, 8)
        self.second = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.middle(torch.relu(self.first(x)))))


def build_model() -> nn.Module:
    return IgnoresMask()


def sample_batch(batch_size: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    inputs = (torch.randn(batch_size, 6), torch.ones(batch_size, 6))
    return inputs, torch.randint(0, 3, (batch_size,))
