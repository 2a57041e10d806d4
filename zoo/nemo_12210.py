"""NeMo#12210 (now NVIDIA-NeMo/Speech#12210) / TransformerEngine#1539: the loss diverges with context parallelism
when the micro-batch holds more than one sequence.

The thread (2025-02-17): LLM pre-training at TP 1, PP 1, CP 2, the loss curve leaves the others as soon as the
micro-batch size (MBS) is 2 or 4 instead of 1; NVIDIA answered that others had hit it too and pointed to
TransformerEngine PR #1539, which the reporter confirmed fixed it (2025-03-14).  The PR's own text is not in the
search index used to write this entry, so the port reconstructs the *kind* of defect the thread describes, not TE's
lines: a ring (KV P2P) causal attention over a sequence laid out head-tail over CP, which at the step where only the
tail half of this rank's queries sees the other rank's keys (its chunk comes later) takes and corrects that half of
the queries, outputs and log-sum-exps through a sequence-first view of a batch-first tensor.  At one sequence per
micro-batch the two views are the same memory (the broken attention is exact); at two, the "tail half" is the second
sequence whole.  Port: the decoder at CP 2 with that attention (FSDP2 over cp, the zoo's sum convention), two
micro-batches of two sequences each (`microbatches=2`, batch 4: MBS 2).  Broken: the halves of the flat memory;
fixed: the halves of the sequence dim."""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from _llama import SEQ, data_parallel, model_case, summand, token_losses
from _twins import twins, variant

from shardcheck.harness.core.zoo_bug import BROKEN, FIXED, Bug

FAMILY = "nemo_12210"
IMPLEMENTATION = __file__
MICROBATCHES = 2

BUG = Bug(
    thread="NVIDIA/NeMo#12210",
    url="https://github.com/NVIDIA-NeMo/Speech/issues/12210",
    title="context-parallel attention right at micro-batch size 1, wrong at 2 or more",
    symptom="the loss curve diverges with CP 2 and MBS 2 or 4 (TP 1, PP 1), matches at MBS 1",
    time_to_find="reported 2025-02-17; TE PR #1539 pointed to 2025-03-10, confirmed fixing it 2025-03-14: 4 weeks",
    fix="NVIDIA/TransformerEngine PR #1539 (its text not read here: not in the search index)",
    topology="dp=1,cp=2,tp=1",
    names=("layers.0.attention",),  # the first attention: the module whose CP path the fix touched
    related=("NVIDIA/TransformerEngine#1539",),
)


def _head_tail_positions(rank: int, size: int) -> torch.Tensor:
    chunk = SEQ // (2 * size)
    head, tail = rank * chunk, (2 * size - 1 - rank) * chunk
    return torch.cat([torch.arange(head, head + chunk), torch.arange(tail, tail + chunk)])


class _GatherReduced(torch.autograd.Function):
    """All-gather over CP (dim 1) whose backward sums every rank's gradient of the gathered tensor."""

    @staticmethod
    def forward(ctx, x, group):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        ctx.rank, ctx.size, ctx.group = dist.get_rank(group), len(parts), group
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None


def _sequence_halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.chunk(2, dim=1)


def _join_sequence(head: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    return torch.cat([head, tail], dim=1)


def _memory_halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The halves a sequence-first ([S, B, ...]) view takes of a batch-first tensor: the flat memory's."""
    b, s = x.shape[:2]
    head, tail = x.contiguous().view(2, -1).unbind(0)
    return head.view(b, s // 2, *x.shape[2:]), tail.view(b, s // 2, *x.shape[2:])


def _join_memory(head: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    b, half = head.shape[:2]
    return torch.stack([head.reshape(-1), tail.reshape(-1)]).view(b, 2 * half, *head.shape[2:])


tail_half = {BROKEN: (_memory_halves, _join_memory), FIXED: (_sequence_halves, _join_sequence)}


def _partial(q, k, v, mask=None):
    """Attention of [B, S, H, D] queries over keys/values: the output and the log-sum-exp [B, S, H]."""
    scores = torch.einsum("bshd,bthd->bhst", q, k) / q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = scores.logsumexp(-1)
    out = torch.einsum("bhst,bthd->bshd", (scores - lse[..., None]).exp(), v)
    return out, lse.transpose(1, 2)


def _merge(out, lse, out_step, lse_step):
    total = torch.logaddexp(lse, lse_step)
    return out * (lse - total).exp()[..., None] + out_step * (lse_step - total).exp()[..., None], total


def attn_forward_with_cp(q, k, v, group, halves):
    """Causal ring attention over CP (every rank's keys and values in turn), the sequence head-tail over the ranks."""
    split, join = halves
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    ks, vs = _GatherReduced.apply(k, group), _GatherReduced.apply(v, group)
    pos = _head_tail_positions(rank, size)
    out, lse = _partial(q, k, v, pos[None, :] <= pos[:, None])  # this rank's own keys: causal by position
    for src in range(size):
        if src < rank:  # every query of this rank sees the head chunk of the other's, none of its tail
            half = k.shape[1] // 2
            out, lse = _merge(out, lse, *_partial(q, ks[src][:, :half], vs[src][:, :half]))
        elif src > rank:  # only this rank's tail queries come after the other's chunks: they see all of them
            q_tail, (o_head, o_tail), (l_head, l_tail) = split(q)[1], split(out), split(lse)
            o_tail, l_tail = _merge(o_tail, l_tail, *_partial(q_tail, ks[src], vs[src]))
            out, lse = join(o_head, o_tail), join(l_head, l_tail)
    return out


def _cp_attention_forward(self, x, position_ids=None):
    """reference.decoder's Attention.forward with the context-parallel attention in place of SDPA."""
    ctx = self.cp_ctx
    b, s, _ = x.shape
    q = self.rope(self.wq(x).view(b, s, -1, self.head_dim), self.position_offset)
    k = self.rope(self.wk(x).view(b, s, -1, self.head_dim), self.position_offset)
    v = self.wv(x).view(b, s, -1, self.head_dim)
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    out = attn_forward_with_cp(q, k, v, ctx.group("cp"), ctx.impl.tail_half[variant(ctx)])
    return self.wo(out.reshape(b, s, -1))


def parallelize(model, ctx):
    for block in model.layers:
        attention = block.attention
        attention.position_offset = _head_tail_positions(ctx.rank("cp"), ctx.size("cp"))
        attention.cp_ctx = ctx
        attention.forward = types.MethodType(_cp_attention_forward, attention)
    data_parallel(model, ctx)
    return model


def _loss(logits, inputs, ctx):
    return token_losses(logits, inputs["targets"]).mean() if ctx is None else summand(logits, inputs, ctx)


def cases(quick: bool = False) -> list:
    def make(v, where):
        return model_case(
            f"{FAMILY}.tail_half", v, where, parallelize, _loss, batch=2 * MICROBATCHES, microbatches=MICROBATCHES
        )

    return twins(BUG, make)
