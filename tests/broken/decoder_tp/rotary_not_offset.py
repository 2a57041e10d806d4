"""BROKEN: context parallel without the rotary positions: torch's context_parallel shards the batch, but the model
keeps rotating each rank's pieces at positions 0, 1, ... of its own local sequence (the positions buffer is never
handed to it), so every CP rank rotates queries and keys at wrong positions (rank 0 those of its head-tail tail
chunk, the others all of theirs).  The first diverging module is layers.0.attention.rope (the queries' rotation)."""

from __future__ import annotations

import torch
from _decoder_plan import data_parallel, loss, tensor_parallel  # noqa: F401  (the example's own TP, FSDP2, loss)
from torch import nn
from torch.distributed.tensor.experimental import context_parallel


def parallelize(model: nn.Module, ctx) -> nn.Module:
    if ctx.size("tp") > 1:
        tensor_parallel(model, ctx.mesh["tp"])
    if ctx.size("cp") > 1:
        positions = torch.arange(ctx.full_shapes["tokens"][1])
        ctx.keep_open(context_parallel(ctx.mesh["cp"], buffers=[positions], buffer_seq_dims=[0],
                                       no_restore_buffers={positions}))
        # the bug: `block.attention.position_offset = positions` is missing: the rotation starts at 0 on every rank
    if ctx.size("dp") * ctx.size("cp") > 1:
        data_parallel(model, ctx.mesh["dp", "cp"]._flatten("dp_cp"))
    return model
