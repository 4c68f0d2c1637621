"""An fp32 residual stream, x = x + f(x): under bf16 autocast each block's Linear computes in
bf16, but the stream stays fp32 (fp32 + bf16 is fp32), so a stage boundary must carry fp32."""

import torch
from torch import nn

WIDTH, BLOCKS, CLASSES = 16, 4, 5


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class ResidualMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block() for _ in range(BLOCKS)])
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def build_model() -> nn.Module:
    return ResidualMLP()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, WIDTH), torch.randint(0, CLASSES, (batch_size,))
