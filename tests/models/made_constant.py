"""A forward that makes a tensor from a Python value (DeBERTa scales its attention by
torch.sqrt(torch.tensor(head_size))): torch.export lifts it into a constant of the graph, which
the model does not hold as an attribute."""

import torch
from torch import nn


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 16)
        self.second = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.first(x))
        h = h / torch.sqrt(torch.tensor(h.size(-1), dtype=torch.float))
        return self.second(h)


def build_model() -> nn.Module:
    return Scaled()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch_size)
    return (torch.randn(batch_size, 16, generator=generator),
            torch.randn(batch_size, 4, generator=generator))


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, targets)
