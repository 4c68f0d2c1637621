"""Llama-3-405B's shape (Llama Team, 2024): 126 layers, width 16,384, 128 query heads and 8
key/value heads, SwiGLU of 53,248, vocabulary 128,256, context 8,192, untied head; 406 B
parameters. Built on meta by pipec; never run here (llama2_70b.py: the layers). ``Llama3``
takes the other sizes (llama3_8b.py)."""

import sys
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # planning only: reuses a sibling
from llama2_70b import Block

LAYERS, WIDTH, HEADS, KV_HEADS, FFN, VOCAB, CONTEXT = 126, 16384, 128, 8, 53248, 128256, 8192


class Llama3(nn.Module):
    def __init__(self, layers: int = LAYERS, width: int = WIDTH, heads: int = HEADS,
                 kv_heads: int = KV_HEADS, ffn: int = FFN) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.Sequential(*[Block(width, heads, kv_heads, ffn) for _ in range(layers)])
        self.norm = nn.RMSNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(idx))))


def build_model() -> nn.Module:
    return Llama3()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (batch_size, CONTEXT + 1))
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
