"""What build_model() may do that a per-stage build must respect: custom initialization
(``self.apply``), a persistent buffer, a buffer outside the state dict computed in __init__ from
random numbers, and a weight tied across the model."""

import torch
from torch import nn

VOCAB, WIDTH = 64, 16


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB, bias=False)
        self.out.weight = self.embed.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, WIDTH))
        self.register_buffer("projection", torch.randn(WIDTH, WIDTH) / WIDTH**0.5,
                             persistent=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.05)
            if module.bias is not None:
                nn.init.uniform_(module.bias, -0.1, 0.1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) * self.scale
        x = torch.tanh(self.mix(x @ self.projection))
        return self.out(x).mean(1)


def build_model() -> nn.Module:
    return Model()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, VOCAB, (batch_size, 8)), torch.randint(0, VOCAB, (batch_size,))
