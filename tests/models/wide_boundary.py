"""Token sequences embedded 512 wide: each sample crosses a cut as 256 × 512 floats (512 KiB)
while its input is 256 token ids (2 KiB), so what a stage holds per micro-batch of the step
(rather than per micro-batch in flight) shows in its measured peak."""

import torch
from torch import nn

VOCAB, TOKENS, WIDTH, CLASSES = 64, 256, 512, 10


class WideBoundary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.mix(self.embed(tokens)).mean(dim=1))


def build_model() -> nn.Module:
    return WideBoundary()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randint(0, VOCAB, (batch_size, TOKENS)),
            torch.randint(0, CLASSES, (batch_size,)))
