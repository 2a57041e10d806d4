"""Megatron-LM#7513 (finding 9 of #7452; Megatron-Bridge#4974): context-parallel ranks normalize a masked loss by
their own valid-token count.

When the loss callback returns each CP shard's loss sum and valid-token count, the micro-batch-averaged path divides
by the shard's local count, and DDP then averages the gradients over DP x CP: with masks that differ between the
shards (a prompt masked out, then the response) the objective changes (one valid token: CP 2 halves the gradient).
Port: the decoder at CP 2 with a loss mask that masks the first quarter of every sequence.  Broken: each rank's
masked mean over its own tokens, averaged over dp x cp; fixed: its masked sum over the token count all-reduced over
dp x cp (PR #7513)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _llama import context_parallel_on, data_parallel, model_case, token_losses
from _twins import twins, variant

from shardcheck.harness.core.zoo_bug import BROKEN, FIXED, Bug

FAMILY = "megatron_lm_7513"
IMPLEMENTATION = __file__

BUG = Bug(
    thread="NVIDIA/Megatron-LM#7513",
    url="https://github.com/NVIDIA/Megatron-LM/pull/7513",
    title="CP ranks normalize the masked loss by their local valid-token count",
    symptom="unequal masks across CP shards change the training objective: with one valid token CP 2 halves the "
    "gradient and CP 4 quarters it",
    time_to_find="found by a tool-assisted audit (#7452, 2026-09-17); PR #7513 two days later, still open",
    fix="open: NVIDIA/Megatron-LM PR #7513 (reduce the token count over the CP group)",
    topology="dp=1,cp=2,tp=1",
    names=("the loss",),
    related=("NVIDIA/Megatron-LM#7452", "NVIDIA-NeMo/Megatron-Bridge#4974"),
)


def _masked_sum_and_count(logits, inputs):
    mask = inputs["loss_mask"].to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
    return (token_losses(logits, inputs["targets"]) * mask).sum(), mask.sum()


def _local_count(logits, inputs, ctx):
    total, count = _masked_sum_and_count(logits, inputs)
    return total / count / (ctx.size("dp") * ctx.size("cp"))  # the local mean, averaged over the ranks


def _global_count(logits, inputs, ctx):
    total, count = _masked_sum_and_count(logits, inputs)
    count = count.clone()
    dist.all_reduce(count, group=ctx.mesh["dp", "cp"]._flatten("dp_cp").get_group())
    return total / count


loss_func = {BROKEN: _local_count, FIXED: _global_count}


def parallelize(model, ctx):
    context_parallel_on(model, ctx)
    data_parallel(model, ctx)
    return model


def _loss(logits, inputs, ctx):
    if ctx is None:
        total, count = _masked_sum_and_count(logits, inputs)
        return total / count
    return ctx.impl.loss_func[variant(ctx)](logits, inputs, ctx)


def cases(quick: bool = False) -> list:
    return twins(BUG, lambda v, where: model_case(f"{FAMILY}.loss_func", v, where, parallelize, _loss, masked=True))
