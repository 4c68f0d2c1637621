"""A 6.3 B-parameter decoder (23.6 GiB of fp32 weights, more than this 24 GiB host can build
whole with gradients): benchmarks/models/wide_decoder.py's blocks (width 2048, context 32), 120
of them. Measured by default block by block (pipec.calibration.blocks)."""

import sys
from pathlib import Path

from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "models"))
from wide_decoder import Decoder, loss_fn, sample_batch  # noqa: F401


def build_model() -> nn.Module:
    return Decoder(layers=120)
