"""GPT-2 medium's shape: 24 layers, width 1024, 16 heads, context 1024, untied head."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # planning only: reuses a sibling
from gpt2_xl import GPT2, loss_fn, sample_batch  # noqa: F401
from torch import nn


def build_model() -> nn.Module:
    return GPT2(layers=24, width=1024, heads=16)
