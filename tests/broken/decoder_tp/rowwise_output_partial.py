"""BROKEN: a plain tensor-parallel plan (no sequence parallelism) whose attention `wo` is row-wise with its output
left Partial: with the default use_local_output each rank hands the residual its unreduced summand, and the sum
over TP never happens.  The first diverging module is layers.0.attention.wo."""

from __future__ import annotations

from _decoder_plan import loss, sequence_and_data_parallel  # noqa: F401  (the example's own CP, FSDP2, loss)
from torch import nn
from torch.distributed.tensor import Partial, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def tensor_parallel(model: nn.Module, ctx) -> nn.Module:
    tp = ctx.mesh["tp"]
    if ctx.size("tp") == 1:
        return model
    parallelize_module(model, tp, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Replicate()),
    })
    for block in model.layers:
        parallelize_module(block, tp, {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Partial()),  # the bug: Replicate() sums the pieces
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
        })
    return model


def parallelize(model: nn.Module, ctx) -> nn.Module:
    tensor_parallel(model, ctx)  # the bug is here; context parallel and FSDP2 as the example's plan
    sequence_and_data_parallel(model, ctx)
    return model
