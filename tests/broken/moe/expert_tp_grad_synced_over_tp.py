"""BROKEN: with expert tensor parallelism the experts' gradients are all-reduced over the tensor-parallel group too,
as a dense replicated weight's would be: each tp rank holds a different slice of the hidden dim, so the sum mixes
slices (Megatron-LM#1628: expert-TP > 1 with EP = 1 syncing over the wrong group).  Right at tp = 1."""

from __future__ import annotations

from shardcheck.distributed_impl.moe import *  # noqa: F403  (the family's other ops, as ours)
from shardcheck.distributed_impl.moe import ExpertParallelMoE, expert_grad_groups, shard_experts, sum_grads


def parallelize(model, ctx):
    shard_experts(model.layer.moe.experts, ctx)
    model.layer.moe = ExpertParallelMoE(model.layer.moe, ctx)
    groups = expert_grad_groups(ctx) + ([ctx.group("tp")] if ctx.size("tp") > 1 else [])  # the bug: tp added
    sum_grads(model, ctx, groups, 1.0)
    return model
