"""BERT from Hugging Face transformers with an attention mask as a second input (padding at the
end of each row), built from a small config (no download); a sequence classifier."""

import torch
from torch import nn
from transformers import BertConfig, BertForSequenceClassification

VOCAB, CONTEXT, CLASSES = 64, 16, 3


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=2, intermediate_size=64,
                            max_position_embeddings=CONTEXT, num_labels=CLASSES,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        self.bert = BertForSequenceClassification(config)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=ids, attention_mask=mask).logits


def build_model() -> nn.Module:
    return Classifier()


def sample_batch(batch_size: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    ids = torch.randint(0, VOCAB, (batch_size, CONTEXT))
    lengths = torch.randint(CONTEXT // 2, CONTEXT + 1, (batch_size, 1))
    mask = (torch.arange(CONTEXT) < lengths).long()
    return (ids, mask), torch.randint(0, CLASSES, (batch_size,))


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, labels)
