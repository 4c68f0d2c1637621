"""A tiny LLaMA-shaped model (benchmarks/zoo/llama2_70b.py at toy sizes): grouped-query
attention (8 query heads, 2 key/value heads), SwiGLU, RMSNorm. Its attention saves the keys and
values unexpanded, as the fused kernels do."""

import torch
from torch import nn
from torch.nn import functional as F

LAYERS, WIDTH, HEADS, KV_HEADS, FFN, VOCAB, CONTEXT = 2, 64, 8, 2, 128, 100, 64


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = WIDTH // HEADS
        self.q = nn.Linear(WIDTH, WIDTH, bias=False)
        self.kv = nn.Linear(WIDTH, 2 * KV_HEADS * self.head_dim, bias=False)
        self.o = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        q = self.q(x).view(batch, tokens, HEADS, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).chunk(2, dim=2)  # unpacked: torch.fx traces it, a generator not
        k = k.view(batch, tokens, KV_HEADS, self.head_dim).transpose(1, 2)
        v = v.view(batch, tokens, KV_HEADS, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(batch, tokens, WIDTH))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(WIDTH)
        self.attn = Attention()
        self.mlp_norm = nn.RMSNorm(WIDTH)
        self.gate = nn.Linear(WIDTH, FFN, bias=False)
        self.up = nn.Linear(WIDTH, FFN, bias=False)
        self.down = nn.Linear(FFN, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH, padding_idx=VOCAB - 1)  # on the last tp rank
        self.blocks = nn.Sequential(*[Block() for _ in range(LAYERS)])
        self.norm = nn.RMSNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(idx))))


def build_model() -> nn.Module:
    return Llama()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (batch_size, CONTEXT + 1))
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
