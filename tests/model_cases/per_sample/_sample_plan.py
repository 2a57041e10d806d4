"""The plan under test of suite `per_sample` (tests/model_cases/per_sample/): tensor parallelism inside each block
(`up` ColwiseParallel, `down` RowwiseParallel) and FSDP2 over `dp`, each rank's loss its summand of the batch's
mean cross-entropy (gradients summed).  Every sample's result is its own: the plan is batch-invariant.  The broken
plans of tests/broken/per_sample/ change one function each."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _sample_model import BATCH, SEQ
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def parallelize(model: nn.Module, ctx) -> nn.Module:
    for block in model.blocks:
        parallelize_module(block, ctx.mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if ctx.size("dp") > 1:
        for block in model.blocks:
            fully_shard(block, mesh=ctx.mesh["dp"])
        fully_shard(model, mesh=ctx.mesh["dp"])
        for module in model.modules():
            if isinstance(module, FSDPModule):  # each rank's loss is its summand of the batch's: sum, do not average
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # gloo has neither PREMUL_SUM nor AVG
    return model


def loss(logits: torch.Tensor, inputs: dict, ctx) -> torch.Tensor:
    """This rank's summand of the batch's mean cross-entropy."""
    logits = logits.float() if logits.dtype == torch.bfloat16 else logits
    return F.cross_entropy(logits.flatten(0, 1), inputs["labels"].flatten(), reduction="sum") / (BATCH * SEQ)
