"""VGG-16 (Simonyan & Zisserman, 2015), configuration D: 13 convolutions, 3 fully connected
layers, 224² images, 1,000 classes; 138,357,544 parameters."""

import torch
from torch import nn

LAYOUT = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


def build_model() -> nn.Module:
    layers: list[nn.Module] = []
    channels = 3
    for item in LAYOUT:
        if item == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(channels, int(item), 3, padding=1), nn.ReLU(inplace=True)]
            channels = int(item)
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(512 * 7 * 7, 4096), nn.ReLU(True),
                         nn.Dropout(), nn.Linear(4096, 4096), nn.ReLU(True), nn.Dropout(),
                         nn.Linear(4096, 1000))


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 3, 224, 224), torch.randint(0, 1000, (batch_size,))
