"""LLaMA-2-13B's shape: 40 layers, width 5120, 40 heads (no grouped-query attention),
SwiGLU of 13824, context 4096, untied head (llama2_70b.py, its other sizes)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # planning only: reuses a sibling
from llama2_70b import Llama, loss_fn, sample_batch  # noqa: F401
from torch import nn


def build_model() -> nn.Module:
    return Llama(layers=40, width=5120, heads=40, kv_heads=40, ffn=13824)
