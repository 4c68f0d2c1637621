"""A forward that derives an index from a buffer (timm's BEiT and Swin read their relative
position bias through ``relative_position_index.view(-1)``): the buffer is made in __init__,
so a model built on meta has no value for it at compile time."""

import torch
from torch import nn


class Biased(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(7, 4))
        self.register_buffer("index", torch.arange(16).remainder(7).view(4, 4), persistent=False)
        self.mix = nn.Linear(4, 4)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.table[self.index.view(-1)].view(4, 4, 4).sum(-1)
        h = torch.relu(self.mix(x.view(-1, 4, 4)) + bias)
        return self.head(h.flatten(1))


def build_model() -> nn.Module:
    return Biased()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch_size)
    return (torch.randn(batch_size, 16, generator=generator),
            torch.randint(0, 3, (batch_size,), generator=generator))
