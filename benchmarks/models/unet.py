"""A small U-Net on 128 × 128 images: BatchNorm, in-place ReLUs, large feature maps and skip
connections that cross stage boundaries (values forwarded through the stages between)."""

import torch
from torch import nn

CLASSES, SIZE = 4, 128


def conv_block(inputs: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(inputs, outputs, 3, padding=1, bias=False),
                         nn.BatchNorm2d(outputs), nn.ReLU(inplace=True),
                         nn.Conv2d(outputs, outputs, 3, padding=1, bias=False),
                         nn.BatchNorm2d(outputs), nn.ReLU(inplace=True))


class UNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down1, self.down2 = conv_block(3, 16), conv_block(16, 32)
        self.down3 = conv_block(32, 64)
        self.pool = nn.MaxPool2d(2)
        self.up2 = nn.ConvTranspose2d(64, 32, 2, stride=2)
        self.dec2 = conv_block(64, 32)
        self.up1 = nn.ConvTranspose2d(32, 16, 2, stride=2)
        self.dec1 = conv_block(32, 16)
        self.head = nn.Conv2d(16, CLASSES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip1 = self.down1(x)
        skip2 = self.down2(self.pool(skip1))
        bottom = self.down3(self.pool(skip2))
        x = self.dec2(torch.cat([self.up2(bottom), skip2], dim=1))
        x = self.dec1(torch.cat([self.up1(x), skip1], dim=1))
        return self.head(x)


def build_model() -> nn.Module:
    return UNet()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    images = torch.randn(batch_size, 3, SIZE, SIZE)
    return images, torch.randint(0, CLASSES, (batch_size, SIZE, SIZE))
