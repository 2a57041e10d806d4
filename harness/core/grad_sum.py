"""`GradSum`: the DDP stand-in a case's run uses for a tensor replicated over mesh dims whose ranks each see only
their own summand of the loss."""

from __future__ import annotations

import torch


class GradSum(torch.autograd.Function):
    """Identity whose backward sums the gradient over each of `groups`: a DDP stand-in for a tensor
    replicated over mesh dims whose ranks each see only their own summand of the loss (a parameter
    under DP, a weight used by every CP rank on its own tokens).  `GradSum.apply(x, (dp_group, ...))`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, groups) -> torch.Tensor:
        ctx.groups = groups
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        # A fresh contiguous buffer: g may be a strided view, and a collective on a non-contiguous
        # tensor reduces the wrong elements.  fp32 or better: no rounding of our own.
        total = g.contiguous().to(torch.promote_types(g.dtype, torch.float32), copy=True)
        for group in ctx.groups:
            if torch.distributed.get_world_size(group) > 1:
                torch.distributed.all_reduce(total, group=group)
        return total.to(g.dtype), None
