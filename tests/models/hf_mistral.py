"""Mistral from Hugging Face transformers with a sliding attention window shorter than the
sequence, built from a small config (no download)."""

import torch
from torch import nn
from transformers import MistralConfig, MistralForCausalLM

VOCAB, CONTEXT, WINDOW = 64, 16, 6


class LogitsOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        config = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=CONTEXT,
                               sliding_window=WINDOW)
        self.mistral = MistralForCausalLM(config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.mistral(input_ids=idx, use_cache=False).logits


def build_model() -> nn.Module:
    return LogitsOnly()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (batch_size, CONTEXT + 1))
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
