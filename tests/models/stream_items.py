"""A model whose training data is an IterableDataset: item i is (i as one feature, i mod 4), in
an order that changes with the epoch (set_epoch), 103 items: not a multiple of any batch."""

from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.data import IterableDataset

ITEMS = 103


class Stream(IterableDataset):
    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = range(ITEMS) if self.epoch % 2 == 0 else reversed(range(ITEMS))
        for i in order:
            yield torch.tensor([float(i)]), torch.tensor(i % 4)


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(1, 16), nn.ReLU(), nn.Linear(16, 4))


def train_dataset() -> IterableDataset:
    return Stream()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.rand(batch_size, 1), torch.randint(0, 4, (batch_size,))
