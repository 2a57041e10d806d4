"""BROKEN: the gradient arriving at the positions' output is summed over DP as it arrives (as if a value every DP rank
holds needed its gradient synchronized like a replicated parameter's), and `wpe.weight`'s gradient is then summed
over DP again by the DDP hook: the gradient at `wpe`'s output is the whole one on every DP rank, not its share."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _gpt2_plan import parallelize as right_plan
from torch import nn


def parallelize(model: nn.Module, ctx) -> nn.Module:
    right_plan(model, ctx)
    if ctx.size("dp") > 1:
        group = ctx.group("dp")

        def summed(g: torch.Tensor) -> torch.Tensor:
            g = g.clone()
            dist.all_reduce(g, group=group)
            return g

        def on_output(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            out.register_hook(summed)  # runs before the harness's hook on the same tensor: it sees the sum

        model.wpe.register_forward_hook(on_output)
    return model
