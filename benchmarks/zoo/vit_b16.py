"""ViT-B/16 (Dosovitskiy et al., 2021): 224² images in 16² patches, 12 layers, width 768,
12 heads, a class token, 1,000 classes; 86.6 M parameters."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # planning only: reuses a sibling
import torch
from gpt2_xl import Block
from torch import nn

IMAGE, PATCH, WIDTH, HEADS, LAYERS, CLASSES = 224, 16, 768, 12, 12, 1000


class ViT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.patches = nn.Conv2d(3, WIDTH, PATCH, PATCH)
        self.cls = nn.Parameter(torch.zeros(1, 1, WIDTH))
        self.pos = nn.Parameter(torch.zeros(1, (IMAGE // PATCH) ** 2 + 1, WIDTH))
        self.blocks = nn.Sequential(*[Block(WIDTH, HEADS, causal=False) for _ in range(LAYERS)])
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patches(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.head(self.norm(self.blocks(x))[:, 0])


def build_model() -> nn.Module:
    return ViT()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 3, IMAGE, IMAGE), torch.randint(0, CLASSES, (batch_size,))
