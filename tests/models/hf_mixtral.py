"""Mixtral from Hugging Face transformers in its default expert implementation, built from a
small config (no download): its experts pick histc's input dtype from the device type (float on
a CPU, int elsewhere), so the graph must be traced on the device the plan trains on."""

import torch
from torch import nn
from transformers import MixtralConfig, MixtralForCausalLM

VOCAB, CONTEXT = 64, 16


class LogitsOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        config = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=2,
                               num_key_value_heads=1, num_local_experts=4,
                               num_experts_per_tok=2, max_position_embeddings=CONTEXT)
        self.mixtral = MixtralForCausalLM(config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.mixtral(input_ids=idx, use_cache=False).logits


def build_model() -> nn.Module:
    return LogitsOnly()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (batch_size, CONTEXT + 1))
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
