"""The plan under test of suite gpt2_positions: torch's TP over `tp` (vocab-parallel `wte`, heads and MLP split
column- then row-wise, `lm_head` gathering the logits; `wpe` left whole on every rank) and DP over `dp` (the batch
split, every parameter's gradient summed over the DP group as it is accumulated, as DDP does)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def tensor_parallel(model: nn.Module, ctx) -> nn.Module:
    if ctx.size("tp") == 1:
        return model
    tp = ctx.mesh["tp"]
    parallelize_module(
        model,
        tp,
        {"wte": RowwiseParallel(input_layouts=Replicate()), "lm_head": ColwiseParallel(output_layouts=Replicate())},
    )
    for block in model.h:
        parallelize_module(
            block,
            tp,
            {
                "attn.q": ColwiseParallel(),
                "attn.k": ColwiseParallel(),
                "attn.v": ColwiseParallel(),
                "attn.o": RowwiseParallel(),
                "mlp.fc": ColwiseParallel(),
                "mlp.proj": RowwiseParallel(),
            },
        )
    return model


def sum_grad_over(group, divide: int = 1) -> Callable[[torch.Tensor], None]:
    """A post-accumulate-grad hook summing the gradient over `group` (then dividing it by `divide`)."""

    def hook(p: torch.Tensor) -> None:
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        dist.all_reduce(grad, group=group)
        if divide != 1:
            grad.div_(divide)

    return hook


def parallelize(model: nn.Module, ctx) -> nn.Module:
    tensor_parallel(model, ctx)
    if ctx.size("dp") > 1:
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(sum_grad_over(ctx.group("dp")))
    return model
