"""An MLP on scikit-learn's real `digits` images (shipped inside the package, no download)."""

import torch
from torch import nn
from torch.utils.data import TensorDataset


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, 10))


def train_dataset() -> TensorDataset:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    return TensorDataset(images, torch.tensor(digits.target))


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.rand(batch_size, 64), torch.randint(0, 10, (batch_size,))
