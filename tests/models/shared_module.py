"""One module called twice: its weight must stay in one stage."""

import torch
from torch import nn


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.twice = nn.Linear(8, 8)
        self.middle = nn.Linear(8, 8)
        self.last = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.twice(torch.relu(self.first(x))))
        x = torch.relu(self.middle(x))
        return self.last(self.twice(x))


def build_model() -> nn.Module:
    return Shared()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 8), torch.randint(0, 3, (batch_size,))
