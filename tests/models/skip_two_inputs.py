"""Two inputs and a skip connection long enough to cross several stages."""

import torch
from torch import nn

WIDTH = 32


class SkipTwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.image = nn.Linear(16, WIDTH)
        self.text = nn.Linear(8, WIDTH)
        self.body = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(6))
        self.head = nn.Linear(2 * WIDTH, 5)

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        skip = self.image(image)
        x = torch.tanh(skip + self.text(text))
        for layer in self.body:
            x = torch.tanh(layer(x))
        # `skip` and the raw `text` input are used again at the very end.
        return self.head(torch.cat([x + skip, x * text.mean(dim=1, keepdim=True)], dim=1))


def build_model() -> nn.Module:
    return SkipTwoInputs()


def sample_batch(batch_size: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    return ((torch.randn(batch_size, 16), torch.randn(batch_size, 8)),
            torch.randint(0, 5, (batch_size,)))
