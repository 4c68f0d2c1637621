"""BERT-large's shape (Devlin et al., 2019): 24 bidirectional layers, width 1024, 16 heads,
sequence 512, vocabulary 30,522, a masked-language-model head (untied here)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # planning only: reuses a sibling
import torch
from gpt2_xl import GPT2, loss_fn  # noqa: F401
from torch import nn

VOCAB, SEQUENCE = 30522, 512


def build_model() -> nn.Module:
    return GPT2(layers=24, width=1024, heads=16, context=SEQUENCE, vocab=VOCAB, causal=False)


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (batch_size, SEQUENCE))
    return tokens, tokens
