"""BROKEN: the learned positions' gradient is averaged over DP (summed, then divided by the DP size) where each DP
rank's loss is already its summand of the global one: `wpe` steps with 1/dp of its gradient."""

from __future__ import annotations

from _gpt2_plan import sum_grad_over, tensor_parallel
from torch import nn


def parallelize(model: nn.Module, ctx) -> nn.Module:
    tensor_parallel(model, ctx)
    if ctx.size("dp") > 1:
        for name, p in model.named_parameters():
            divide = ctx.size("dp") if name == "wpe.weight" else 1
            p.register_post_accumulate_grad_hook(sum_grad_over(ctx.group("dp"), divide))
    return model
