"""An MLP on scikit-learn's real `digits` images (shipped inside the package, no download), with
a held-out split, an accuracy metric, and per-item work in the dataset (a random shift), which
loader workers can run ahead of the step."""

import torch
from torch import nn
from torch.utils.data import Dataset

HELD_OUT = 297  # the last 297 of the 1,797 images


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, 10))


class Digits(Dataset):
    """Images as 64 values in [0, 1]; each item shifted by a pixel or none, chosen by its index
    (so every process computes the same item)."""

    def __init__(self, rows: slice) -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        self.images = torch.tensor(digits.data[rows], dtype=torch.float32) / 16.0
        self.targets = torch.tensor(digits.target[rows])

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        shift = index % 3 - 1
        image = torch.roll(self.images[index].view(8, 8), shifts=shift, dims=1).reshape(64)
        return image, self.targets[index]


def train_dataset() -> Dataset:
    return Digits(slice(0, -HELD_OUT))


def eval_dataset() -> Dataset:
    return Digits(slice(-HELD_OUT, None))


def eval_metrics(output: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"accuracy": (output.argmax(dim=1) == targets).float().mean()}


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.rand(batch_size, 64), torch.randint(0, 10, (batch_size,))
