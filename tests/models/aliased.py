"""A model that writes into a view of its input: cuts 1 and 2 would send x and its view
``head`` apart before the write reaches x, so no stage may start at nodes 1 or 2."""

import torch
from torch import nn


class Aliased(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        head = x[:, :2]
        y = torch.tanh(x)
        head.mul_(2)
        return y + x


def build_model() -> nn.Module:
    return Aliased()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 4), torch.randint(0, 4, (batch_size,))
