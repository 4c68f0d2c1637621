"""Control flow on a tensor's value: torch.fx cannot trace it (nor can torch.export on meta)."""

import torch
from torch import nn


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.outer = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inner(x)
        if x.sum() > 0:
            x = torch.relu(x)
        return self.outer(x)


def build_model() -> nn.Module:
    return Gate()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 8), torch.randint(0, 3, (batch_size,))
