"""Values that cross stage boundaries transposed (non-contiguous) and a batch-1 broadcast."""

import torch
from torch import nn


class Transposed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Linear(6, 12)
        self.tokens = nn.Linear(5, 5)
        self.head = nn.Linear(12 * 5, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.features(x))  # (batch, 5, 12)
        t = h.transpose(1, 2)  # (batch, 12, 5), a non-contiguous view
        t = torch.tanh(self.tokens(t)).transpose(1, 2)
        return self.head((t + h).flatten(1))


def build_model() -> nn.Module:
    return Transposed()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 5, 6), torch.randint(0, 4, (batch_size,))
