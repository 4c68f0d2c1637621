"""GPT-2 from Hugging Face transformers, built from a small config (no download): torch.fx cannot
trace it, torch.export can. Its output head shares the token embedding's weight."""

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB, CONTEXT = 128, 16


class LogitsOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        config = GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=32, n_layer=2, n_head=2,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        self.gpt = GPT2LMHeadModel(config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gpt(input_ids=idx, use_cache=False).logits


def build_model() -> nn.Module:
    return LogitsOnly()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (batch_size, CONTEXT + 1))
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
