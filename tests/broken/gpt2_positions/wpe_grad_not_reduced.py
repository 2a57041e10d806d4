"""BROKEN: the DP all-reduce is hooked on every parameter but the learned positions' (as if `wpe` were made after the
model was wrapped for DDP): each DP rank steps `wpe` with its own rows' share of its gradient (the forward and every
activation's gradient are right; `wpe.weight`'s gradient and its value after the step are not)."""

from __future__ import annotations

from _gpt2_plan import sum_grad_over, tensor_parallel
from torch import nn


def parallelize(model: nn.Module, ctx) -> nn.Module:
    tensor_parallel(model, ctx)
    if ctx.size("dp") > 1:
        for name, p in model.named_parameters():
            if name != "wpe.weight":
                p.register_post_accumulate_grad_hook(sum_grad_over(ctx.group("dp")))
    return model
