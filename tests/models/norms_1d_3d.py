"""BatchNorm1d on (N, C) and (N, C, L) inputs and BatchNorm3d, for the rewrite tests."""

import torch
from torch import nn


class Norms(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.flat = nn.Linear(4, 12)
        self.bn_flat = nn.BatchNorm1d(12)
        self.seq = nn.Conv1d(12, 12, 1)
        self.bn_seq = nn.BatchNorm1d(12)
        self.vol = nn.Conv3d(12, 8, 1)
        self.bn_vol = nn.BatchNorm3d(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn_flat(self.flat(x)))  # (N, 12)
        x = torch.relu(self.bn_seq(self.seq(x.unsqueeze(2).expand(-1, -1, 5))))  # (N, 12, 5)
        x = self.bn_vol(self.vol(x.unsqueeze(3).unsqueeze(4).expand(-1, -1, -1, 2, 2)))
        return self.head(x.mean(dim=(2, 3, 4)))


def build_model() -> nn.Module:
    return Norms()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 4), torch.randint(0, 3, (batch_size,))
