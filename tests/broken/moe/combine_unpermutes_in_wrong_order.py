"""BROKEN: `combine` takes the returned rows in dispatch's sorted order (rows[order]) where it must put them back
(row i to position order[i]): every token gets another (token, slot)'s expert output.  Wrong at every topology, the
MoE layer's output first."""

from __future__ import annotations

import torch

from shardcheck.distributed_impl import moe as ours
from shardcheck.distributed_impl.moe import *  # noqa: F403  (the family's other ops, as ours)


def combine(rows: torch.Tensor, routing, weights: torch.Tensor) -> torch.Tensor:
    by_source = ours.unpermute(rows, routing.regroup)
    back = ours._exchange(by_source, routing.send_splits, routing.recv_splits, routing.group)
    slots = back[routing.order].view(weights.shape[0], routing.top_k, -1)  # the bug: the permutation, not its inverse
    return (slots * weights[..., None].to(slots.dtype)).sum(1)


class CombineInWrongOrder(ours.ExpertParallelMoE):
    combine = staticmethod(combine)


def parallelize(model, ctx):
    ours.shard_experts(model.layer.moe.experts, ctx)
    model.layer.moe = CombineInWrongOrder(model.layer.moe, ctx)
    ours.sum_grads(model, ctx, ours.expert_grad_groups(ctx), ours.expert_grad_scale(ctx))
    return model
