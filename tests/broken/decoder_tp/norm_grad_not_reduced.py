"""BROKEN: the layers' attention norms are left out of the plan: each TP rank normalizes its sequence shard with a plain weight, whose gradient holds only its own tokens' part and is never all-reduced over TP (the forward is right; the norm weight's gradient and its value after the step are not)."""

from __future__ import annotations

from _decoder_plan import loss, sequence_and_data_parallel  # noqa: F401  (the example's own CP, FSDP2, loss)
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)


def tensor_parallel(model: nn.Module, ctx) -> nn.Module:
    tp = ctx.mesh["tp"]
    if ctx.size("tp") == 1:
        return model
    parallelize_module(model, tp, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for block in model.layers:
        parallelize_module(block, tp, {
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })
    return model


def parallelize(model: nn.Module, ctx) -> nn.Module:
    tensor_parallel(model, ctx)  # the bug is here; context parallel and FSDP2 as the example's plan
    sequence_and_data_parallel(model, ctx)
    return model
