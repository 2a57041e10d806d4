"""BROKEN: the experts' gradients are left EP times too large: the plan normalises them for an average over their
expert-data-parallel group alone, as if each expert had seen only its edp ranks' tokens, where the dense ones are
normalised over all dp (Megatron-LM PR #5956, first blamed on NCCL rounding).  Right at ep = 1; at ep > 1 the expert
weights' gradients (and their values after the step) are ep times off."""

from __future__ import annotations

from shardcheck.distributed_impl.moe import *  # noqa: F403  (the family's other ops, as ours)
from shardcheck.distributed_impl.moe import ExpertParallelMoE, expert_grad_groups, shard_experts, sum_grads


def parallelize(model, ctx):
    shard_experts(model.layer.moe.experts, ctx)
    model.layer.moe = ExpertParallelMoE(model.layer.moe, ctx)
    sum_grads(model, ctx, expert_grad_groups(ctx), float(ctx.size("ep")))  # the bug: should be 1 (÷dp, not ÷edp)
    return model
