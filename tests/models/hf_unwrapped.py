"""A Hugging Face model returned as it is, with no wrapper: forward returns a ModelOutput, which
loss_fn reads (``output.logits``). Its cache is off in the config. transformers loads its
modules when first used, so the output's type is defined only once build_model runs."""

import torch
import transformers
from torch import nn

VOCAB, CONTEXT = 64, 16


def build_model() -> nn.Module:
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=CONTEXT, use_cache=False)
    return transformers.Qwen2ForCausalLM(config)


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (batch_size, CONTEXT + 1))
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(output: object, targets: torch.Tensor) -> torch.Tensor:
    logits = output.logits  # type: ignore[attr-defined]
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
