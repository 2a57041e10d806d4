"""BROKEN: the router's load-balancing loss counts its tokens over the expert-parallel group (the ranks it exchanges
tokens with) instead of the whole data-parallel batch: each edp group's f_e and token count stand for the batch's, so
the loss summed over dp is off wherever dp > ep (the loss, then the router's gradient)."""

from __future__ import annotations

from shardcheck.distributed_impl.moe import *  # noqa: F403  (the family's other ops, as ours)
from shardcheck.distributed_impl.moe import (
    ExpertParallelMoE,
    expert_grad_groups,
    expert_grad_scale,
    shard_experts,
    sum_grads,
)


class AuxOverEp(ExpertParallelMoE):
    def aux_group(self):
        return self.ctx.group("ep")  # the bug: the batch is split over dp


def parallelize(model, ctx):
    shard_experts(model.layer.moe.experts, ctx)
    model.layer.moe = AuxOverEp(model.layer.moe, ctx)
    sum_grads(model, ctx, expert_grad_groups(ctx), expert_grad_scale(ctx))
    return model
