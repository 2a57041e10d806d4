"""A small decoder in plain torch, as torchtitan's llama writes it: token embedding, per layer RMSNorm → rotary
attention over SDPA (causal, grouped key/value heads) and RMSNorm → SwiGLU MLP with residuals, a final RMSNorm and
the output projection.  Attention and MLP infer their local head and hidden counts from their weights' shapes
(`view(B, S, -1, head_dim)`), so a tensor-parallel plan that shards the projections runs the same code.

The single-device reference of the built-in `decoder` model suite (and the model of examples/decoder_tp): the
model, and `loss`, the mean next-token negative log-likelihood its training step minimizes.  `position_ids`
(optional): where each of this piece's tokens sits in the sequence, as a context-parallel batch carries them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardcheck.reference.model_utils import next_token_logprobs


@dataclass(frozen=True)
class Config:
    vocab: int = 32
    dim: int = 16
    layers: int = 2
    heads: int = 4
    kv_heads: int = 4
    hidden: int = 32
    eps: float = 1e-6


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Rotary(nn.Module):
    """Rotary embedding of [B, S, H, D] at positions `offset + arange(S)` (`offset`: where this piece of the sequence
    starts; 0 for the whole sequence), at the positions `offset` lists ([S]: a context-parallel rank's pieces, as a
    plan's CP buffer holds them), or at `position_ids` ([B, S] or [1, S], as a context-parallel batch carries them)."""

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        self.register_buffer(
            "inv_freq", base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim), persistent=False
        )

    def forward(
        self, x: torch.Tensor, offset: int | torch.Tensor = 0, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        if position_ids is None and isinstance(offset, torch.Tensor):
            pos = offset.to(x.device, torch.float64).view(1, x.shape[1])
        elif position_ids is None:
            pos = torch.arange(offset, offset + x.shape[1], dtype=torch.float64, device=x.device)[None]
        else:  # [B, S] or [1, S]: a context-parallel piece's positions are not contiguous
            pos = position_ids.to(x.device, torch.float64).view(-1, x.shape[1])
        angles = pos[..., None] * self.inv_freq.to(x.device)  # [B|1, S, D/2]
        cos, sin = angles.cos().to(x.dtype)[:, :, None], angles.sin().to(x.dtype)[:, :, None]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.head_dim = cfg.dim // cfg.heads
        self.wq = nn.Linear(cfg.dim, cfg.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * self.head_dim, cfg.dim, bias=False)
        self.rope = Rotary(self.head_dim)
        # where this rank's sequence starts, or its positions (a context-parallel plan sets them)
        self.position_offset: int | torch.Tensor = 0
        # this rank's key/value heads out of all of them, where a tensor-parallel plan keeps wk/wv whole because TP
        # splits the query heads finer than the key/value heads (kv_heads < tp); None: k's and v's heads as they come
        self.select_kv: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q = self.rope(q, self.position_offset, position_ids)
        k = self.rope(k, self.position_offset, position_ids)
        if self.select_kv is not None:
            k, v = self.select_kv(k), self.select_kv(v)
        rep = q.shape[2] // k.shape[2]  # grouped heads: each key/value head serves `rep` query heads
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        # positions only when given: a plan's PrepareModuleInput on `attention` expects one positional input
        a = self.attention_norm(x)
        h = x + (self.attention(a) if position_ids is None else self.attention(a, position_ids=position_ids))
        return h + self.feed_forward(self.ffn_norm(h))


class Decoder(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim, cfg.eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h) if position_ids is None else layer(h, position_ids=position_ids)
        return self.output(self.norm(h))


def build(cfg: Config, gen: torch.Generator) -> Decoder:
    """The decoder with every weight drawn from `gen` (norm weights near 1, projections ~ 1/sqrt(fan-in))."""
    model = Decoder(cfg).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else noise / p.shape[-1] ** 0.5)
    return model


def loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of every next token (position t scores tokens[:, t+1]), over the whole batch:
    what the model suite's sharded step (model_utils' vocab-parallel log-probs, reduce_loss over DP) must give."""
    return -next_token_logprobs(logits, tokens).mean().to(logits.dtype)  # log-softmax math in float32 at least
