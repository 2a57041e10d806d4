"""An honest MoE plan that holds its experts as DTensors on the expert mesh (`expert_mesh(ctx.mesh)["ep", "tp"]`,
`[Shard(0), Shard(2)]` for w1 [E, D, H]) instead of plain local tensors: the harness reads their layouts from the
placements (ep and tp), with no param_layouts to match.  Everything else is ours."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from shardcheck.distributed_impl import moe as ours
from shardcheck.distributed_impl.moe import *  # noqa: F403  (the family's other ops, as ours)
from shardcheck.harness.core.topology import expert_mesh


def _dtensor_experts(experts: nn.Module, ctx) -> None:
    mesh = expert_mesh(ctx.mesh)["ep", "tp"]
    for name, hidden_dim in (("w1", 2), ("w2", 1)):
        full = getattr(experts, name)
        shape = list(full.shape)
        shape[0] //= ctx.size("ep")
        shape[hidden_dim] //= ctx.size("tp")
        local = torch.empty(shape, dtype=full.dtype, device=full.device)
        placements = [Shard(0), Shard(hidden_dim)]
        piece = DTensor.from_local(local, mesh, placements, shape=full.shape, stride=full.stride())
        setattr(experts, name, nn.Parameter(piece))


def parallelize(model, ctx):
    _dtensor_experts(model.layer.moe.experts, ctx)
    model.layer.moe = ours.ExpertParallelMoE(model.layer.moe, ctx)
    ours.sum_grads(model, ctx, ours.expert_grad_groups(ctx), ours.expert_grad_scale(ctx))
    return model
