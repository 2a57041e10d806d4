"""NVIDIA/TransformerEngine#1557 (and Megatron-LM#1464/#1465): with context parallelism the attention's forward is
right and its dQ, dK, dV are wrong.

TE's `AttnFuncWithCPAndKVP2P.backward` returned activation gradients of core attention that left the single-GPU
ones (relative error up to 1.2), which polluted `linear_qkv`'s weight gradient and everything below it.  Port: causal
attention on a sequence laid out head-tail over CP 2 (rank r holds chunks r and 3 - r of 4), each rank attending with
its queries to the keys and values gathered from every CP rank.  Broken: the gathered keys' and values' gradient
kept as this rank's own queries made it (the other ranks' queries' share of this rank's dK and dV never sent back);
fixed: the gradient of the gather reduced over CP, each rank keeping its chunks' sum (what a ring's backward
accumulates as the dKV travels round)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _twins import twins, variant

from shardcheck import Case, HeadTail, Layout
from shardcheck.harness.core.zoo_bug import BROKEN, FIXED, Bug

FAMILY = "transformer_engine_1557"
IMPLEMENTATION = __file__

BUG = Bug(
    thread="NVIDIA/TransformerEngine#1557",
    url="https://github.com/NVIDIA/TransformerEngine/issues/1557",
    title="context-parallel attention backward (KV P2P) returns wrong dQ, dK, dV",
    symptom="same parameters and data as single-GPU training: core attention's dQ/dK/dV relative error up to 1.2, "
    "main_grad relative error up to 2.3",
    time_to_find="reported 2025-03-11 (also as Megatron-LM#1464 and #1465), closed",
    fix="closed in TransformerEngine after the report (see the thread)",
    topology="dp=1,cp=2,tp=1",
    names=("grad:k", "grad:v"),
    related=("NVIDIA/Megatron-LM#1464", "NVIDIA/Megatron-LM#1465"),
)

BATCH, SEQ, HEADS, DIM = 2, 8, 2, 4
LAYOUT = Layout(cp=HeadTail(1))


def _head_tail_positions(seq: int, rank: int, size: int) -> torch.Tensor:
    chunk = seq // (2 * size)
    head, tail = rank * chunk, (2 * size - 1 - rank) * chunk
    return torch.cat([torch.arange(head, head + chunk), torch.arange(tail, tail + chunk)])


class _GatherOwnGradOnly(torch.autograd.Function):
    """All-gather over CP whose backward keeps this rank's slice of its own gradient (nothing reduced)."""

    @staticmethod
    def forward(ctx, x, group):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.rank, ctx.size = dist.get_rank(group), len(parts)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.size, dim=1)[ctx.rank], None


class _GatherReduced(torch.autograd.Function):
    """All-gather over CP whose backward sums every rank's gradient of the gathered tensor and keeps this slice."""

    @staticmethod
    def forward(ctx, x, group):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.rank, ctx.size, ctx.group = dist.get_rank(group), len(parts), group
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.size, dim=1)[ctx.rank], None


def causal_attention(q, k, v, q_pos, k_pos):
    """softmax(q·kᵀ/√d, causal by position)·v over [B, S, H, D]."""
    scores = torch.einsum("bshd,bthd->bhst", q, k) / DIM**0.5
    scores = scores.masked_fill(k_pos[None, None, None, :] > q_pos[None, None, :, None], float("-inf"))
    return torch.einsum("bhst,bthd->bshd", scores.softmax(-1), v)


def _attention_with(gather):
    def attention(q, k, v, group):
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        positions = torch.cat([_head_tail_positions(SEQ, r, size) for r in range(size)])
        k_all, v_all = gather.apply(k, group), gather.apply(v, group)
        return causal_attention(q, k_all, v_all, _head_tail_positions(SEQ, rank, size), positions)

    return attention


attn_forward_func_with_cp = {BROKEN: _attention_with(_GatherOwnGradOnly), FIXED: _attention_with(_GatherReduced)}


def _make_inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {n: torch.randn(BATCH, SEQ, HEADS, DIM, generator=gen, dtype=torch.float64) for n in "qkv"}


def _reference(inputs):
    positions = torch.arange(SEQ)
    return causal_attention(inputs["q"], inputs["k"], inputs["v"], positions, positions)


def _case(v: str, where: dict) -> Case:
    return Case(
        op=f"{FAMILY}.attn_forward_func_with_cp",
        case_id=v,
        make_inputs=_make_inputs,
        reference=_reference,
        run=lambda impl, ctx, i: impl.attn_forward_func_with_cp[variant(ctx)](i["q"], i["k"], i["v"], ctx.group("cp")),
        input_layouts={"q": LAYOUT, "k": LAYOUT, "v": LAYOUT},
        output_layouts=(LAYOUT,),
        grad_inputs=("q", "k", "v"),
        **where,
    )


def cases(quick: bool = False) -> list:
    return twins(BUG, _case)
