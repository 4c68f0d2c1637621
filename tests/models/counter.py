"""A model whose output depends on how many forwards it has run (a buffer updated in place).

Any forward the runtime adds (a shape-inference run, say) changes the losses, just as it would
change BatchNorm's running statistics.
"""

import torch
from torch import nn


def counted(x: torch.Tensor, calls: torch.Tensor) -> torch.Tensor:
    calls.add_(1)
    return x + 0.05 * calls


torch.fx.wrap("counted")  # a leaf for torch.fx: traced as one call, not evaluated at trace time


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 16)
        self.second = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.first(x))
        x = counted(torch.relu(self.second(x)), self.calls)
        return self.head(x)


def build_model() -> nn.Module:
    return Counter()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 6), torch.randint(0, 3, (batch_size,))
