"""Llama-3-8B's shape: 32 layers, width 4,096, 32 query heads and 8 key/value heads, SwiGLU of
14,336, vocabulary 128,256, context 8,192, untied head (llama3_405b.py, its other sizes)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # planning only: reuses a sibling
from llama3_405b import Llama3, loss_fn, sample_batch  # noqa: F401
from torch import nn


def build_model() -> nn.Module:
    return Llama3(layers=32, width=4096, heads=32, kv_heads=8, ffn=14336)
