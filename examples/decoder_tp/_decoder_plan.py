"""The decoder's parallelization plan over every mesh dim, as torchtitan writes llama's:

- `tp`: tensor parallel with sequence parallelism (embedding row-wise into sequence-sharded activations,
  sequence-parallel norms, column-wise q/k/v and w1/w3, row-wise wo and w2 back to the sequence shards, a
  column-wise output projection gathering the logits); where TP splits the query heads finer than the key/value
  heads (kv_heads < tp), wk and wv are kept whole on every rank, which takes the key/value head its query heads use;
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
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


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
        ctx.keep_open(
            context_parallel(ctx.mesh["cp"], buffers=[positions], buffer_seq_dims=[0], no_restore_buffers={positions})
        )
        for block in model.layers:
            block.attention.position_offset = positions  # this rank's two chunks, head-tail
    if ctx.size("dp") * ctx.size("cp") > 1:
        data_parallel(model, ctx.mesh["dp", "cp"]._flatten("dp_cp"))


def kv_head_of_rank(rank: int, tp: int, kv_heads: int) -> int:
    """The key/value head TP rank `rank` needs when kv_heads < tp: its query heads [rank·H/tp, (rank+1)·H/tp) all
    use kv head h // (H/kv_heads), which is rank·kv_heads // tp (vLLM's tp_rank // num_kv_head_replicas)."""
    return rank * kv_heads // tp


def tensor_parallel(model: nn.Module, tp, kv_head=kv_head_of_rank) -> None:
    parallelize_module(
        model,
        tp,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for block in model.layers:
        parallelize_module(
            block,
            tp,
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "attention.wq": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            },
        )
        kv_heads = block.attention.wk.out_features // block.attention.head_dim
        if kv_heads % tp.size() == 0:
            parallelize_module(block, tp, {"attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel()})
        else:
            key_value_heads_whole(block.attention, tp, kv_head(tp.get_local_rank(), tp.size(), kv_heads))


def key_value_heads_whole(attention: nn.Module, tp, head: int) -> None:
    """kv_heads < tp: wk and wv replicated over tp (each rank computes every key/value head), and the attention takes
    key/value head `head` for this rank's query heads, as vLLM replicates key/value heads (num_kv_head_replicas)."""
    for linear in (attention.wk, attention.wv):  # the input is the attention's replicated DTensor
        distribute_module(linear, tp, output_fn=lambda module, out, mesh: out.to_local())
    attention.select_kv = lambda x: _copy_to_tp(x, tp)[:, :, head : head + 1]


def _copy_to_tp(x: torch.Tensor, tp) -> torch.Tensor:
    """Identity forward, gradient summed over tp backward (Megatron's copy_to_tensor_model_parallel_region): each
    rank's gradient of the whole k (or v) is its own query heads' share of it."""
    return DTensor.from_local(x, tp, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


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
