"""Two Linear layers of 4.3 B parameters in all (16 GiB of fp32 weights), built on meta: too big
to measure whole on this host, and no run of identical blocks to measure one at a time."""

import torch
from torch import nn


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(65536, 65536), nn.ReLU(), nn.Linear(65536, 16))


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.rand(batch_size, 65536), torch.randint(0, 16, (batch_size,))
