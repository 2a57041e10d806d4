"""Single-device reference of a mixture-of-experts (MoE) layer, dropless, as Mixtral / Qwen3-MoE / DeepSeek route:

- `route(logits, top_k)`: softmax over the experts (in float32 at least), the top-k experts of each token, their
  probabilities renormalized to sum to 1.
- `dispatch(x, experts, num_experts)`: every (token, slot) row grouped by expert, tokens in order within an expert
  (the order an expert-parallel all-to-all delivers them: docs/ops/moe.md), as a dense [E, T, D] tensor whose row
  (e, t) is token t where t is routed to e, 0 elsewhere (the layout-friendly form the harness compares).
- `combine(y, weights, experts)`: out[t] = sum_j weights[t, j] * y[experts[t, j], t].
- `aux_loss(logits, experts, num_experts)`: the Switch / GShard load-balancing loss E * sum_e f_e * P_e, f_e the
  fraction of (token, slot) assignments to expert e, P_e the mean router probability of e, over the whole batch.
- `MoE`: router (Linear D -> E), experts (SwiGLU-free two-layer SiLU MLPs, weights [E, D, H] and [E, H, D]),
  optional shared expert; its output is the weighted sum of each token's experts (plus the shared expert's), and
  `aux` holds the load-balancing loss of its last call.
- `build(cfg, gen)`: a small decoder whose MLP is the MoE layer (`moe_decoder`), router margins kept wide enough
  that bfloat16 routes every token as float64 does.

Plain torch, differentiable by ordinary autograd, any dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardcheck.reference import math_dtype
from shardcheck.reference.decoder import Attention, RMSNorm
from shardcheck.reference.decoder import Config as DecoderConfig
from shardcheck.reference.decoder import loss as next_token_loss


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in the logits' dtype, experts [T, k] int64) of router logits [T, E]."""
    probs = torch.softmax(logits.to(math_dtype(logits.dtype)), dim=-1)
    weights, experts = probs.topk(top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(logits.dtype), experts


def dispatch(x: torch.Tensor, experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Dense [E, T, D]: row (e, t) is x[t] where token t is routed to expert e, 0 elsewhere."""
    routed = F.one_hot(experts, num_experts).sum(1).to(x.dtype)  # [T, E]: 1 where routed (top-k experts distinct)
    return routed.t()[:, :, None] * x[None]


def combine(y: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """[T, D]: each token's experts' outputs (dense y [E, T, D]) weighted by its routing weights."""
    tokens = torch.arange(experts.shape[0], device=experts.device)[:, None]
    return (y[experts, tokens] * weights[..., None]).sum(1)


def aux_loss(logits: torch.Tensor, experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """E * sum_e f_e * P_e over the whole batch of router logits [T, E] and its top-k experts [T, k]."""
    probs = torch.softmax(logits.to(math_dtype(logits.dtype)), dim=-1)
    counts = torch.bincount(experts.reshape(-1), minlength=num_experts).to(probs.dtype)
    fraction = counts / experts.numel()
    return (num_experts * (fraction * probs.mean(0)).sum()).to(logits.dtype)


def expert_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert: silu(x @ w1) @ w2 (w1 [D, H], w2 [H, D])."""
    return F.silu(x @ w1) @ w2


@dataclass(frozen=True)
class Config:
    vocab: int = 16
    dim: int = 8
    experts: int = 8
    top_k: int = 2
    hidden: int = 8  # each expert's
    shared_hidden: int = 8  # the shared expert's (0: none)
    heads: int = 2
    aux_coef: float = 0.1


class Experts(nn.Module):
    """The experts' weights, [E, D, H] and [E, H, D].  Never called as a module: its rows arrive grouped by expert
    (`compute`), a shape no layer-by-layer comparison maps."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(cfg.experts, cfg.dim, cfg.hidden))
        self.w2 = nn.Parameter(torch.empty(cfg.experts, cfg.hidden, cfg.dim))

    def compute(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows grouped by expert (`counts[e]` of expert e, in order) through their experts."""
        pieces = rows.split(counts)
        return torch.cat([expert_mlp(p, self.w1[e], self.w2[e]) for e, p in enumerate(pieces)])


class SharedExpert(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.shared_hidden, bias=False)
        self.w2 = nn.Linear(cfg.shared_hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)))


class MoE(nn.Module):
    """Router, experts and an optional shared expert on [B, S, D]; `aux`: the load-balancing loss of the last call."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.dim, cfg.experts, bias=False)
        self.experts = Experts(cfg)
        self.shared = SharedExpert(cfg) if cfg.shared_hidden else None
        self.aux: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        tokens = x.reshape(-1, d)
        logits = self.router(x).reshape(-1, self.cfg.experts)
        weights, experts = route(logits, self.cfg.top_k)
        self.aux = aux_loss(logits, experts, self.cfg.experts)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) rows grouped by expert, tokens in order
        counts = torch.bincount(flat, minlength=self.cfg.experts).tolist()
        y = self.experts.compute(tokens[order // self.cfg.top_k], counts)
        slots = torch.empty_like(y).index_copy(0, order, y).view(-1, self.cfg.top_k, d)
        out = (slots * weights[..., None]).sum(1)
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.view(b, s, d)


class Block(nn.Module):
    """MoE MLP first, then attention: the router sees each token's own normed embedding, so its routing is a
    function of the token id that `build` can keep clear of ties in every dtype."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.ffn_norm = RMSNorm(cfg.dim, 1e-6)
        self.moe = MoE(cfg)
        self.attention_norm = RMSNorm(cfg.dim, 1e-6)
        self.attention = Attention(DecoderConfig(vocab=cfg.vocab, dim=cfg.dim, heads=cfg.heads, kv_heads=cfg.heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.moe(self.ffn_norm(x))
        return h + self.attention(self.attention_norm(h))


class MoEDecoder(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layer = Block(cfg)
        self.norm = RMSNorm(cfg.dim, 1e-6)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, the MoE layer's load-balancing loss)."""
        logits = self.output(self.norm(self.layer(self.tok_embeddings(tokens))))
        return logits, self.layer.moe.aux


MIN_MARGIN = 0.5  # router logits: k-th best minus (k+1)-th, for every token id (bfloat16 errs by ~0.05 here)


def routing_margin(logits: torch.Tensor, top_k: int) -> float:
    """The smallest gap between a row's k-th and (k+1)-th largest logits."""
    top = logits.detach().topk(top_k + 1, dim=-1).values  # a number, not part of any graph
    return float((top[:, top_k - 1] - top[:, top_k]).min())


def build(cfg: Config, gen: torch.Generator) -> MoEDecoder:
    """The MoE decoder, weights drawn from `gen`; the router redrawn until every token id routes with a margin of
    MIN_MARGIN (its input is the token's normed embedding)."""
    model = MoEDecoder(cfg).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            fan_in = p.shape[-2] if name.startswith("layer.moe.experts.") else p.shape[-1]
            p.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else noise / fan_in**0.5)
        moe = model.layer.moe
        normed = model.layer.ffn_norm(model.tok_embeddings.weight)
        for _ in range(1000):
            w = torch.randn(moe.router.weight.shape, generator=gen, dtype=torch.float64) * 6 / cfg.dim**0.5
            if routing_margin(normed @ w.t(), cfg.top_k) >= MIN_MARGIN:
                moe.router.weight.copy_(w)
                break
        else:
            raise ValueError(f"no router of margin {MIN_MARGIN} in 1000 draws for {cfg}")
    return model


def loss(logits: torch.Tensor, aux: torch.Tensor, tokens: torch.Tensor, aux_coef: float) -> torch.Tensor:
    """The decoder's mean next-token NLL plus aux_coef times the MoE layer's load-balancing loss."""
    return next_token_loss(logits, tokens) + aux_coef * aux.to(logits.dtype)
