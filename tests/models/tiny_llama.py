"""A tiny Llama from Hugging Face transformers, built from a config (no download), held as
``self.lm``: its state-dict keys are ``lm.`` + Hugging Face's. Rotary embeddings (a buffer
computed in __init__, not persistent), RMSNorm, gated MLP, grouped-query attention, tied
embeddings."""

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, CONTEXT = 128, 16
CONFIG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
              tie_word_embeddings=True)


class LogitsOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lm = LlamaForCausalLM(LlamaConfig(**CONFIG))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=idx, use_cache=False).logits


def build_model() -> nn.Module:
    return LogitsOnly()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (batch_size, CONTEXT + 1))
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
