"""ResNet-50 (He et al., 2016), written out by hand: bottleneck blocks [3, 4, 6, 3], 224 × 224
images, 1,000 classes, 25,557,032 parameters (the torchvision layout, stride on the 3 × 3 conv).
"""

import torch
from torch import nn

BLOCKS, WIDTHS, EXPANSION = (3, 4, 6, 3), (64, 128, 256, 512), 4


class Bottleneck(nn.Module):
    def __init__(self, channels_in: int, width: int, stride: int) -> None:
        super().__init__()
        out = width * EXPANSION
        self.conv1 = nn.Conv2d(channels_in, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or channels_in != out:
            self.downsample = nn.Sequential(nn.Conv2d(channels_in, out, 1, stride, bias=False),
                                            nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        return self.relu(self.bn3(self.conv3(y)) + identity)


class ResNet50(nn.Module):
    def __init__(self, classes: int = 1000, blocks_per_layer: tuple[int, ...] = BLOCKS) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64),
                                  nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
        layers: list[nn.Module] = []
        channels = 64
        for i, (blocks, width) in enumerate(zip(blocks_per_layer, WIDTHS, strict=True)):
            for b in range(blocks):
                layers.append(Bottleneck(channels, width, 2 if i > 0 and b == 0 else 1))
                channels = width * EXPANSION
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


def build_model() -> nn.Module:
    return ResNet50()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 3, 224, 224), torch.randint(0, 1000, (batch_size,))
