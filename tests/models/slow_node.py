"""A model with one node of known duration: it sleeps 20 ms forward and 40 ms backward, so a
profile must give that node those times and the others almost nothing."""

import time

import torch
from torch import fx, nn

FORWARD_S = 0.02
BACKWARD_S = 0.04


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        time.sleep(FORWARD_S)
        return x * 2

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(BACKWARD_S)
        return grad * 2


def slow(x: torch.Tensor) -> torch.Tensor:
    return _Sleep.apply(x)  # type: ignore[no-any-return]


fx.wrap("slow")


class Slow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 16)
        self.last = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(torch.relu(slow(self.first(x))))


def build_model() -> nn.Module:
    return Slow()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 16), torch.randint(0, 4, (batch_size,))
