"""BROKEN: the plan swaps each block's LayerNorm for a fused one whose per-token mean comes from one running sum over
the whole local batch (each token's sum the difference of two running totals, as a kernel that streams the flattened
batch does: the mechanism of NeMo-RL#1227).  Every value is within rounding of the right one (the step's value checks
pass in float64), but a sample's bits depend on the samples before it: only batch invariance sees it, at the first
block's norm."""

from __future__ import annotations

import torch
from _sample_plan import loss  # noqa: F401  (the plan's loss, unchanged)
from _sample_plan import parallelize as tensor_and_data_parallel
from torch import nn


def _streamed_layer_norm(norm: nn.LayerNorm):
    def forward(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        running = flat.flatten().cumsum(0).view_as(flat)[:, -1]  # one accumulator over the flattened batch
        sums = running - torch.cat([running.new_zeros(1), running[:-1]])
        centred = x - (sums / x.shape[-1]).view(*x.shape[:-1], 1)
        variance = centred.pow(2).mean(-1, keepdim=True)
        return centred * torch.rsqrt(variance + norm.eps) * norm.weight + norm.bias

    return forward


def parallelize(model: nn.Module, ctx) -> nn.Module:
    for block in model.blocks:
        block.norm.forward = _streamed_layer_norm(block.norm)
    return tensor_and_data_parallel(model, ctx)
