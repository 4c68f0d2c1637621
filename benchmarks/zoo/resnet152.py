"""ResNet-152 (He et al., 2016): ResNet-50's bottlenecks, [3, 8, 36, 3]; 60,192,808 parameters."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # planning only: reuses a sibling
from resnet50 import ResNet50, sample_batch  # noqa: F401
from torch import nn


def build_model() -> nn.Module:
    return ResNet50(blocks_per_layer=(3, 8, 36, 3))
