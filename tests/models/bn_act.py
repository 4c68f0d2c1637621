"""A BatchNorm subclass with its own forward (batch norm, then its activation), as timm's
BatchNormAct2d is: torch.fx traces through it, so the graph holds F.batch_norm, not a module."""

import torch
from torch import nn
from torch.nn import functional as F


class BatchNormAct2d(nn.BatchNorm2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                         self.training, self.momentum, self.eps)
        return F.relu(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn1 = BatchNormAct2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = BatchNormAct2d(32)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bn2(self.conv2(self.bn1(self.conv1(x))))
        return self.head(x.mean(dim=(2, 3)))


def build_model() -> nn.Module:
    return Net()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch_size)
    return (torch.randn(batch_size, 3, 8, 8, generator=generator),
            torch.randint(0, 10, (batch_size,), generator=generator))
