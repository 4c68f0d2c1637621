"""Tokens through a tensor-parallel MLP, then a head that reads across the sequence (a flatten):
under sequence parallelism the residual stream is split between the MLP and the head, and
gathered before the flatten."""

import torch
import torch.nn.functional as F
from torch import nn

TOKENS, FEATURES = 8, 16


class TokenMixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, FEATURES)
        self.norm = nn.LayerNorm(FEATURES)
        self.up = nn.Linear(FEATURES, 4 * FEATURES)
        self.down = nn.Linear(4 * FEATURES, FEATURES)
        self.final = nn.LayerNorm(FEATURES)
        self.head = nn.Linear(TOKENS * FEATURES, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h + self.down(F.gelu(self.up(self.norm(h))))
        return self.head(self.final(h).flatten(1))


def build_model() -> nn.Module:
    return TokenMixer()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, TOKENS, 6), torch.randint(0, 5, (batch_size,))
