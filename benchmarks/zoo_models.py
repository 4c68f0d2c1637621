"""Third-party models for benchmarks/zoo.py and the tests: a model file's source for a timm or
torchvision model built with random weights (no download), shrunk by its own arguments."""

from __future__ import annotations

from pathlib import Path

SOURCE = '''"""{title}"""

import torch
from torch import nn

{imports}

SIZE, CLASSES = {size}, 10


def build_model() -> nn.Module:
    return {build}


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch_size)
    return (torch.randn(batch_size, 3, SIZE, SIZE, generator=generator),
            torch.randint(0, CLASSES, (batch_size,), generator=generator))
'''


def timm_model(name: str, size: int, **kwargs: object) -> str:
    arguments = "".join(f", {key}={value!r}" for key, value in kwargs.items())
    return SOURCE.format(title=f"timm's {name}, random weights", imports="import timm",
                         size=size, build=f"timm.create_model({name!r}, pretrained=False, "
                         f"num_classes=CLASSES{arguments})")


def torchvision_model(name: str, size: int, **kwargs: object) -> str:
    arguments = "".join(f", {key}={value!r}" for key, value in kwargs.items())
    return SOURCE.format(title=f"torchvision's {name}, random weights",
                         imports="from torchvision import models", size=size,
                         build=f"models.{name}(weights=None, num_classes=CLASSES{arguments})")


def write(source: str, directory: Path, name: str) -> Path:
    path = directory / f"{name}.py"
    path.write_text(source)
    return path
