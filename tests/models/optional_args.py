"""A model whose forward takes optional arguments that the inputs do not supply (timm's
attn_mask=None), one of them used only when given."""

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.fc1(x).relu()
        if mask is not None:
            h = h * mask
        return x + self.fc2(h)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor, scale: float = 1.0,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, attn_mask)
        return self.head(x * scale)


def build_model() -> nn.Module:
    return Model()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch_size)
    return (torch.randn(batch_size, 16, generator=generator),
            torch.randint(0, 10, (batch_size,), generator=generator))
