"""Products and convolutions of several kinds (pipec.frontend.kernels): two equal Linears, two
convolutions that differ only in stride, and attention."""

import torch
from torch import nn
from torch.nn import functional as F


class KernelCalls(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.c1 = nn.Conv2d(1, 2, 3, padding=1)
        self.c2 = nn.Conv2d(2, 2, 3, padding=1, stride=2)
        self.head = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(self.a(x)).view(-1, 1, 8, 8)
        q = self.c2(self.c1(h)).flatten(2)
        return self.head(F.scaled_dot_product_attention(q, q, q).flatten(1))


def build_model() -> nn.Module:
    return KernelCalls()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 8, 8), torch.randint(0, 3, (batch_size,))
