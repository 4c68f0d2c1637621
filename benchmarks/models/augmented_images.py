"""A small CNN on scikit-learn's digits, upsampled to 32 × 32 with per-item augmentation (a
random crop, flip and blur, seeded by the item's index): data that needs work per item, for
benchmarks/data_loader.py."""

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

SIZE = 32
BLUR = torch.tensor([1.0, 4.0, 6.0, 4.0, 1.0]) / 16


def build_model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(32 * 8 * 8, 10))


class Augmented(Dataset):
    def __init__(self) -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = torch.tensor(digits.data, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
        self.images = F.interpolate(images, size=SIZE + 4, mode="bilinear")
        self.targets = torch.tensor(digits.target)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(index)
        top, left = torch.randint(0, 5, (2,), generator=generator).tolist()
        image = self.images[index, :, top:top + SIZE, left:left + SIZE]
        if torch.rand((), generator=generator) < 0.5:
            image = image.flip(-1)
        for _ in range(8):  # a heavy blur: the per-item work a real pipeline's decoding costs
            image = F.conv2d(image[None], BLUR.view(1, 1, 1, 5), padding=(0, 2))[0]
            image = F.conv2d(image[None], BLUR.view(1, 1, 5, 1), padding=(2, 0))[0]
        return image, self.targets[index]


def train_dataset() -> Dataset:
    return Augmented()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.rand(batch_size, 1, SIZE, SIZE), torch.randint(0, 10, (batch_size,))
