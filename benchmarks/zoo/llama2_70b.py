"""LLaMA-2-70B's shape (Touvron et al., 2023): 80 layers, width 8192, 64 query heads and 8
key/value heads (grouped-query attention), SwiGLU feed-forward of 28,672, RMSNorm, vocabulary
32,000, context 4096, untied output head; 69 B parameters. Rotary embeddings are left out (their
cost is a few elementwise operations per layer). Built on meta by pipec; never run here.
``Llama`` takes the other sizes (llama2_7b.py, llama2_13b.py)."""

import torch
from torch import nn
from torch.nn import functional as F

LAYERS, WIDTH, HEADS, KV_HEADS, FFN, VOCAB, CONTEXT = 80, 8192, 64, 8, 28672, 32000, 4096


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.width, self.heads, self.kv_heads = width, heads, kv_heads
        self.head_dim = width // heads
        self.q = nn.Linear(width, width, bias=False)
        self.kv = nn.Linear(width, 2 * kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        q = self.q(x).view(batch, tokens, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).chunk(2, dim=2)  # unpacked: torch.fx traces it, a generator not
        k = k.view(batch, tokens, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, tokens, self.kv_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.kv_heads != self.heads)
        return self.o(y.transpose(1, 2).reshape(batch, tokens, self.width))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(width)
        self.attn = Attention(width, heads, kv_heads)
        self.mlp_norm = nn.RMSNorm(width)
        self.gate = nn.Linear(width, ffn, bias=False)
        self.up = nn.Linear(width, ffn, bias=False)
        self.down = nn.Linear(ffn, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, layers: int = LAYERS, width: int = WIDTH, heads: int = HEADS,
                 kv_heads: int = KV_HEADS, ffn: int = FFN) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.Sequential(*[Block(width, heads, kv_heads, ffn)
                                      for _ in range(layers)])
        self.norm = nn.RMSNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(idx))))


def build_model() -> nn.Module:
    return Llama()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (batch_size, CONTEXT + 1))
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
