"""T5 from Hugging Face transformers, encoder and decoder, with two inputs (the source tokens
and the shifted target tokens), built from a small config (no download)."""

import torch
from torch import nn
from transformers import T5Config, T5ForConditionalGeneration

VOCAB, CONTEXT = 64, 12


class Seq2Seq(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        config = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                          num_decoder_layers=2, num_heads=2, dropout_rate=0.0,
                          decoder_start_token_id=0, use_cache=False)
        self.t5 = T5ForConditionalGeneration(config)

    def forward(self, source: torch.Tensor, shifted: torch.Tensor) -> torch.Tensor:
        return self.t5(input_ids=source, decoder_input_ids=shifted, use_cache=False).logits


def build_model() -> nn.Module:
    return Seq2Seq()


def sample_batch(batch_size: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    source = torch.randint(1, VOCAB, (batch_size, CONTEXT))
    target = torch.randint(1, VOCAB, (batch_size, CONTEXT))
    shifted = torch.cat([torch.zeros(batch_size, 1, dtype=torch.long), target[:, :-1]], dim=1)
    return (source, shifted), target


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
