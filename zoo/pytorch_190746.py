"""pytorch#190746: inside `loss_parallel()`, a log_softmax not consumed by cross_entropy gets an identity backward.

`loss_parallel` registers a process-wide handler for `aten._log_softmax_backward_data` that returns the upstream
gradient unchanged, correct only when `nll_loss`'s fused backward adds the softmax term; any other consumer of a
vocab-sharded log_softmax (DPO's and ORPO's `(log_softmax(logits) * weights).sum()`) gets d/dx log_softmax = I
instead of I - softmax·1ᵀ, silently.  Port: that consumer on logits split over the vocabulary at TP 2.  Broken:
torch 2.13's own `loss_parallel` (the handler is still the identity); fixed: the backward the fix (pytorch PR
#191479 / #191606) computes, grad - softmax·all_reduce(Σ grad), written as an autograd function."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _twins import twins, variant
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel

from shardcheck import Case, Layout
from shardcheck.harness.core.zoo_bug import BROKEN, FIXED, Bug

FAMILY = "pytorch_190746"
IMPLEMENTATION = __file__

BUG = Bug(
    thread="pytorch/pytorch#190746",
    url="https://github.com/pytorch/pytorch/issues/190746",
    title="loss_parallel() gives identity gradients to any log_softmax not consumed by cross_entropy",
    symptom="silently wrong gradients for DPO/ORPO-style losses under loss_parallel; the forward is right",
    time_to_find="reported 2026-07-22; fix PRs #191479 (closed) and #191606 (open) within 8 days, none merged",
    fix="open: pytorch PR #191606 (the distributed log_softmax Jacobian in the backward handler)",
    topology="dp=1,cp=1,tp=2",
    names=("grad:logits",),
    related=("pytorch/pytorch#191479", "pytorch/pytorch#191606"),
)

BATCH, SEQ, VOCAB = 2, 3, 16


def _in_loss_parallel(logits: torch.Tensor, weights: torch.Tensor, ctx) -> torch.Tensor:
    ctx.keep_open(loss_parallel())  # the backward runs inside the context too, as a training step's does
    mesh = ctx.mesh["tp"]
    log_p = torch.log_softmax(DTensor.from_local(logits, mesh, [Shard(-1)]), dim=-1)
    return (log_p * DTensor.from_local(weights, mesh, [Shard(-1)])).sum(-1).full_tensor()


class _VocabParallelLogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, group):
        top = logits.max(-1, keepdim=True).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        sum_exp = (logits - top).exp().sum(-1, keepdim=True)
        dist.all_reduce(sum_exp, group=group)
        out = logits - top - sum_exp.log()
        ctx.group = group
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        total = grad.sum(-1, keepdim=True)
        dist.all_reduce(total, group=ctx.group)
        return grad - out.exp() * total, None


class _SumOverTP(torch.autograd.Function):
    """Sum of the ranks' partial sums; its gradient is the one upstream gradient of the replicated result."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _fixed_backward(logits: torch.Tensor, weights: torch.Tensor, ctx) -> torch.Tensor:
    group = ctx.group("tp")
    log_p = _VocabParallelLogSoftmax.apply(logits, group)
    return _SumOverTP.apply((log_p * weights).sum(-1), group)


weighted_log_probs = {BROKEN: _in_loss_parallel, FIXED: _fixed_backward}


def _make_inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "logits": 2 * torch.randn(BATCH, SEQ, VOCAB, generator=gen, dtype=torch.float64),
        "weights": torch.randn(BATCH, SEQ, VOCAB, generator=gen, dtype=torch.float64),
    }


def _reference(inputs):
    return (torch.log_softmax(inputs["logits"], -1) * inputs["weights"]).sum(-1)


def _run(impl, ctx, inputs):
    return impl.weighted_log_probs[variant(ctx)](inputs["logits"], inputs["weights"], ctx)


def _case(v: str, where: dict) -> Case:
    return Case(
        op=f"{FAMILY}.weighted_log_probs",
        case_id=v,
        make_inputs=_make_inputs,
        reference=_reference,
        run=_run,
        input_layouts={"logits": Layout(tp=Shard(-1)), "weights": Layout(tp=Shard(-1))},
        output_names=("score",),
        grad_inputs=("logits",),
        **where,
    )


def cases(quick: bool = False) -> list:
    return twins(BUG, _case)
