"""A small GPT-2-like decoder with learned positions: `wte(ids) + wpe(arange(S))`, where `wpe`'s output [S, D] has
no batch dim (the same on every DP rank), then pre-norm blocks of causal multi-head attention and a GELU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, HIDDEN, SEQ, LAYERS = 16, 8, 2, 16, 8, 2
HEAD_DIM = DIM // HEADS


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(3))
        self.k = nn.Linear(DIM, DIM, bias=False)  # a key bias's gradient is exactly zero: softmax ignores a shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # this rank's heads: all, or its share under TP
            return t.view(b, s, -1, HEAD_DIM).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, HIDDEN)
        self.act = nn.GELU()
        self.proj = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(DIM), Attention(), nn.LayerNorm(DIM), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.wpe = nn.Embedding(SEQ, DIM)
        self.h = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.wte(ids) + self.wpe(positions)  # [B, S, D] + [S, D]
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build(gen: torch.Generator) -> GPT:
    model = GPT().double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            p.copy_(1 + 0.2 * noise if ".ln_" in f".{name}" else noise / p.shape[-1] ** 0.5)
    return model
