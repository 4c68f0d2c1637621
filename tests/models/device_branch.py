"""Device-dependent model code, as libraries write it: one branch on an activation's device
(torch.fx cannot trace it, torch.export can) and one on a weight's (a concrete value under
either front end). Traced on meta, both would take their non-CPU path and a CPU run would train
another model."""

import torch
from torch import nn


class DeviceBranches(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.first = nn.Linear(width, width)
        self.second = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.first(x))
        if next(self.parameters()).device.type != "cpu":
            h = h + 1.0
        scale = 0.5 if h.device.type == "cpu" else 2.0
        return self.second(h * scale)


class WeightBranchOnly(DeviceBranches):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.first(x))
        if next(self.parameters()).device.type != "cpu":
            h = h + 1.0
        return self.second(h)


def build_model() -> nn.Module:
    return DeviceBranches()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch_size)
    return (torch.randn(batch_size, 16, generator=generator),
            torch.randn(batch_size, 4, generator=generator))


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, targets)
