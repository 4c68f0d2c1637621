"""Two things torch.export writes into less common graph shapes: a torch.no_grad() region that
makes a tensor on the input's device (M2M100's positions: a submodule graph of its own), and a
complex view (FNet's Fourier transform, then .real) in two identical blocks."""

import torch
from torch import nn


class Fourier(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + torch.fft.fft(x).real)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Fourier(8), Fourier(8))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            positions = torch.arange(x.size(1), device=x.device, dtype=x.dtype) / x.size(1)
        return self.head(self.blocks(x + positions))


def build_model() -> nn.Module:
    return Model()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch_size)
    return (torch.randn(batch_size, 8, generator=generator),
            torch.randint(0, 3, (batch_size,), generator=generator))
