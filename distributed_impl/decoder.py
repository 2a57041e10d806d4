"""The decoder's training step over (dp, cp, tp), as NeMo-RL / Automodel write one around the seed families:

- `parallelize(model, ctx)`: tensor parallel over `tp` (torch's `parallelize_module`: the embedding row-wise, q/k/v
  and w1/w3 column-wise, wo and w2 row-wise, the output projection column-wise into vocab-parallel logits); the
  batch sharded over `cp` by `cp_utils.make_cp_batch_and_ctx` (head-tail, ring attention inside its context) as the
  model is called; gradients summed over `dp` and `cp` as each one is accumulated (DDP's all-reduce).
- `loss(logits, tokens, ctx)`: `model_utils.from_parallel_logits_to_logprobs` on the vocab-parallel logits (over
  TP, gathered over CP), the sum reported through `distributed_utils.reduce_loss` over DP.

Each seed family is the module under test of its own `--impl` (`ctx.module(family)`), so someone else's model_utils
or cp_utils runs inside this step and a wrong op shows where it first bites.  Contract: docs/model-cases.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def _tensor_parallel(model: nn.Module, ctx) -> None:
    tp = ctx.mesh["tp"]
    parallelize_module(
        model,
        tp,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(),  # local [B, S, V/TP] logits: what from_parallel_logits_to_logprobs takes
        },
    )
    for block in model.layers:
        parallelize_module(
            block,
            tp,
            {
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
            },
        )


def _shard_batch_over_cp(model: nn.Module, ctx) -> None:
    """The model's call goes through cp_utils: its batch sharded head-tail, position ids with it, inside the CP
    context (kept open by the harness through the backward, as a training loop keeps its train context)."""
    cp_utils = ctx.module("cp_utils")

    def pre_hook(module, args, kwargs):
        batch = {"input_ids": args[0].clone()}  # sharded in place: never the caller's tensor
        context, batch = cp_utils.make_cp_batch_and_ctx(ctx.mesh, batch)
        ctx.keep_open(context())
        return (batch["input_ids"],), {**kwargs, "position_ids": batch.get("position_ids")}

    model.register_forward_pre_hook(pre_hook, with_kwargs=True)


def _sum_grads_over_dp_cp(model: nn.Module, ctx) -> None:
    """Each rank's gradient is its summand of the full one (its batch rows, its sequence positions): summed over
    `dp` and `cp` as soon as it is accumulated."""
    groups = [ctx.group(dim) for dim in ("dp", "cp") if ctx.size(dim) > 1]
    if not groups:
        return

    def reduce(p: torch.Tensor) -> None:
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        for group in groups:
            dist.all_reduce(grad, group=group)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(reduce)


def parallelize(model: nn.Module, ctx) -> nn.Module:
    """The decoder's plan on this rank (in place: parameter names kept)."""
    if ctx.size("tp") > 1:
        _tensor_parallel(model, ctx)
    _shard_batch_over_cp(model, ctx)
    _sum_grads_over_dp_cp(model, ctx)
    return model


def loss(logits: torch.Tensor, tokens: torch.Tensor, ctx) -> torch.Tensor:
    """The mean next-token NLL of the whole batch, on every rank, from this rank's [B/DP, S/CP, V/TP] logits and
    its [B/DP, S] tokens.  Its value is reduce_loss's (summed over DP); its gradient is this rank's summand of the
    full one: every CP rank holds the whole sequence's log-probs (their gather sums the CP ranks' gradients), so
    each takes 1/CP of its rows' sum."""
    model_utils, distributed_utils = ctx.module("model_utils"), ctx.module("distributed_utils")
    v_local = logits.shape[-1]
    start = ctx.rank("tp") * v_local
    tp_group = ctx.group("tp") if ctx.size("tp") > 1 else None
    cp_group = ctx.group("cp") if ctx.size("cp") > 1 else None
    logprobs = model_utils.from_parallel_logits_to_logprobs(
        logits, tokens, start, start + v_local, tp_group, cp_group=cp_group
    )
    # summed in float32 at least, as the reference's log-softmax math (docs/ops/README.md)
    local_sum = -logprobs.to(torch.promote_types(logprobs.dtype, torch.float32)).sum()
    dp_group = ctx.group("dp") if ctx.size("dp") > 1 else None
    total, count = distributed_utils.reduce_loss([local_sum], torch.tensor(logprobs.numel()), dp_group=dp_group)
    mean = (total / count).reshape(()).to(local_sum.dtype)
    summand = local_sum / count.to(local_sum.dtype).reshape(()) / ctx.size("cp")
    # in the logits' dtype, as the reference's: a float32 scalar from bfloat16 logits would be judged by float32 ulps
    return (summand + (mean - summand).detach()).to(logits.dtype)
