"""GPT-2 XL's shape (Radford et al., 2019): 48 layers, width 1600, 25 heads, context 1024,
vocabulary 50,257, learned positions, untied output head. Built on meta by pipec; never run here.
"""

import torch
from torch import nn
from torch.nn import functional as F

LAYERS, WIDTH, HEADS, CONTEXT, VOCAB = 48, 1600, 25, 1024, 50257


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, causal: bool = True) -> None:
        super().__init__()
        self.width, self.heads, self.causal = width, heads, causal
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = x.shape
        q, k, v = self.qkv(x).split(self.width, dim=2)
        q, k, v = (t.view(batch, tokens, self.heads, width // self.heads).transpose(1, 2)
                   for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(batch, tokens, width))


class Block(nn.Module):
    """A pre-norm transformer block (GPT-2, ViT; BERT is post-norm but costs the same)."""

    def __init__(self, width: int, heads: int, causal: bool = True) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads, causal)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT2(nn.Module):
    def __init__(self, layers: int = LAYERS, width: int = WIDTH, heads: int = HEADS,
                 context: int = CONTEXT, vocab: int = VOCAB, causal: bool = True) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, width)
        self.pos_emb = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*[Block(width, heads, causal) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(positions)
        return self.head(self.ln_f(self.blocks(x)))


def build_model() -> nn.Module:
    return GPT2()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (batch_size, CONTEXT + 1))
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
