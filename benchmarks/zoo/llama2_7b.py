"""LLaMA-2-7B's shape: 32 layers, width 4096, 32 heads (no grouped-query attention),
SwiGLU of 11008, context 4096, untied head (llama2_70b.py, its other sizes)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # planning only: reuses a sibling
from llama2_70b import Llama, loss_fn, sample_batch  # noqa: F401
from torch import nn


def build_model() -> nn.Module:
    return Llama(layers=32, width=4096, heads=32, kv_heads=32, ffn=11008)
