"""The decoder's parallelization plan over every mesh dim, as torchtitan writes llama's:

- `tp`: tensor parallel with sequence parallelism (embedding row-wise into sequence-sharded activations,
  sequence-parallel norms, column-wise q/k/v and w1/w3, row-wise wo and w2 back to the sequence shards, a
  column-wise output projection gathering the logits);
- `cp`: torch's `context_parallel` (SDPA becomes ring attention; on CPU through shardcheck's shim), the batch in
  torch's head-tail load-balanced layout, and the rotary positions a buffer it shards the same way;
- `dp` (and `cp`): FSDP2 (`fully_shard`) per block and at the root over the flattened dp x cp mesh, which also
  reduces the gradients over CP; each rank's loss is its summand of the global mean (`loss`), so the gradients are
  summed, never averaged, over the ranks.

The module under test of the `decoder_tp` example: `--impl decoder_tp=other_plan.py` checks another plan (it
defines `parallelize(model, ctx)` and `loss(logits, inputs, ctx)`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)


def parallelize(model: nn.Module, ctx) -> nn.Module:
    if ctx.size("tp") > 1:
        tensor_parallel(model, ctx.mesh["tp"])
    sequence_and_data_parallel(model, ctx)
    return model


def sequence_and_data_parallel(model: nn.Module, ctx) -> None:
    """torch's context_parallel over cp, then FSDP2 over dp x cp."""
    if ctx.size("cp") > 1:
        # the rotary positions are a buffer context_parallel shards as it shards the batch (torchtitan's freqs_cis);
        # kept open through the backward: torch's CP has its attention backward only inside the context
        positions = torch.arange(ctx.full_shapes["tokens"][1])
        ctx.keep_open(context_parallel(ctx.mesh["cp"], buffers=[positions], buffer_seq_dims=[0],
                                       no_restore_buffers={positions}))
        for block in model.layers:
            block.attention.position_offset = positions  # this rank's two chunks, head-tail
    if ctx.size("dp") * ctx.size("cp") > 1:
        data_parallel(model, ctx.mesh["dp", "cp"]._flatten("dp_cp"))


def tensor_parallel(model: nn.Module, tp) -> None:
    parallelize_module(model, tp, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for block in model.layers:
        parallelize_module(block, tp, {
            "attention_norm": SequenceParallel(),
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


def data_parallel(model: nn.Module, mesh) -> None:
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):  # each rank's loss is already its share of the mean: sum, do not average
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has neither PREMUL_SUM nor AVG


def loss(logits: torch.Tensor, inputs: dict, ctx) -> torch.Tensor:
    """This rank's summand of the mean next-token cross-entropy: its tokens' sum over the global token count."""
    targets = inputs["targets"]
    tokens = targets.numel() * ctx.size("dp") * ctx.size("cp")
    logits = logits.float() if logits.dtype == torch.bfloat16 else logits
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") / tokens
