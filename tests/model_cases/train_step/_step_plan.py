"""The plan under test of suite `train_step` (tests/model_cases/train_step/): tensor parallelism inside each block
(`up` ColwiseParallel, `down` RowwiseParallel) and FSDP2 over `dp` (each rank's loss is its summand of the step's:
gradients summed, not averaged), the loss over the step's tokens, and clipping by the global norm over DTensor
gradients on different meshes.  The broken plans of tests/broken/train_step/ change one function each."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _step_model import IGNORE
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

MIXED_PRECISION = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def parallelize(model: nn.Module, ctx, mp_policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    for block in model.blocks:
        parallelize_module(block, ctx.mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if ctx.size("dp") > 1 or mp_policy is not None:  # (FSDP2 applies the policy, at dp 1 too)
        for block in model.blocks:
            fully_shard(block, mesh=ctx.mesh["dp"], mp_policy=mp_policy or MixedPrecisionPolicy())
        fully_shard(model, mesh=ctx.mesh["dp"], mp_policy=mp_policy or MixedPrecisionPolicy())
        for module in model.modules():
            if isinstance(module, FSDPModule):  # each rank's loss is its summand of the step's: sum, do not average
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # gloo has neither PREMUL_SUM nor AVG
    return model


def parallelize_hsdp(model: nn.Module, ctx, mp_policy: MixedPrecisionPolicy | None = None) -> nn.Module:
    """HSDP: `fully_shard` on the 2-D data mesh (replicated over "dp_replicate", sharded over "dp_shard"), gradients
    summed over both (each rank's loss is its summand); no TP (the data mesh is the whole of a dp-only topology)."""
    mesh = ctx.data_mesh()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy or MixedPrecisionPolicy())
    fully_shard(model, mesh=mesh, mp_policy=mp_policy or MixedPrecisionPolicy())
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def parallelize_mixed_precision(model: nn.Module, ctx) -> nn.Module:
    """The same plan under FSDP2's mixed precision: bf16 parameters in the forward and backward, fp32 reduction."""
    return parallelize(model, ctx, MIXED_PRECISION)


def parallelize_hsdp_mixed_precision(model: nn.Module, ctx) -> nn.Module:
    """HSDP under FSDP2's mixed precision: every feature of the step at once on the 2-D data mesh."""
    return parallelize_hsdp(model, ctx, MIXED_PRECISION)


def loss(logits: torch.Tensor, inputs: dict, ctx) -> torch.Tensor:
    """This rank's micro-batch's summand of the step's mean cross-entropy: its tokens' sum over every token of the
    step (all micro-batches, all DP ranks), as Transformers' fix of 2024 does (`num_items_in_batch`)."""
    logits = logits.float() if logits.dtype == torch.bfloat16 else logits
    nll = F.cross_entropy(logits.flatten(0, 1), inputs["labels"].flatten(), ignore_index=IGNORE, reduction="sum")
    return nll / inputs["tokens_in_step"]


def clip_grad(params: list[nn.Parameter], max_norm: float, ctx) -> torch.Tensor:
    """Clipping by the global norm: each gradient's norm over all its shards (a DTensor's norm is reduced over its
    mesh by full_tensor), then the norm of those norms; torch's clip_grad_norm_ would stack DTensors of different
    meshes (the blocks' 2-D dp x tp, the head's dp)."""
    grads = [p.grad for p in params if p.grad is not None]
    norms = [torch.linalg.vector_norm(g) for g in grads]
    total = torch.linalg.vector_norm(torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]))
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(scale.item())
    return total


def optimizer(params: list[nn.Parameter], lr: float, ctx) -> torch.optim.Optimizer:
    """torch's AdamW (weight decay 0.1, so that a wrong decay shows): the plan's optimizer and the reference's."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.1)
