"""The small decoder the zoo's model pairs share (shardcheck.reference.decoder: token embedding, rotary attention,
SwiGLU MLP, RMSNorms, an output projection) and the pieces of a torchtitan-style plan its pairs put together:

- `tensor_parallel`: TP with sequence parallelism (embedding row-wise into sequence shards, SequenceParallel norms,
  column-wise q/k/v/w1/w3, row-wise wo/w2, the output projection gathering the logits); `final_norm=False` leaves the
  final norm's weight a plain replica that sees only its sequence shard;
- `context_parallel_on`: torch's context_parallel over cp, the rotary positions sharded with the batch
  (`offsets=False`: the positions never handed to the attention);
- `data_parallel`: FSDP2 over dp x cp, gradients summed (each rank's loss is its summand of the global one), built of
  `fully_shard_on(model, mesh)` (any mesh: the 2-D data mesh is HSDP) and `sum_gradients(model)`;
- `model_case`: the ModelCase of a pair, the batch split over dp and laid out head-tail over cp (a batch size,
  the step's token count as an input, and further fields such as `microbatches` or `hsdp` where a pair needs them)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from shardcheck import HeadTail, Layout, ModelCase
from shardcheck.reference.decoder import Config, build

BATCH, SEQ = 2, 8
DEFAULT = Config()
BATCH_LAYOUT = Layout(dp=Shard(0), cp=HeadTail(1))


def tensor_parallel(model: nn.Module, tp, final_norm: bool = True) -> None:
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    if final_norm:
        top["norm"] = SequenceParallel()
    parallelize_module(model, tp, top)
    for block in model.layers:
        parallelize_module(
            block,
            tp,
            {
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
            },
        )


def context_parallel_on(model: nn.Module, ctx, offsets: bool = True) -> None:
    positions = torch.arange(ctx.full_shapes["tokens"][1])
    # kept open through the backward: torch's CP has its attention backward only inside the context
    ctx.keep_open(
        context_parallel(ctx.mesh["cp"], buffers=[positions], buffer_seq_dims=[0], no_restore_buffers={positions})
    )
    if offsets:
        for block in model.layers:
            block.attention.position_offset = positions  # this rank's two chunks, head-tail


def data_parallel(model: nn.Module, ctx) -> None:
    if ctx.size("dp") * ctx.size("cp") == 1:
        return
    fully_shard_on(model, ctx.mesh["dp", "cp"]._flatten("dp_cp"))
    sum_gradients(model)  # each rank's loss is already its share of the mean: sum, never average


def sum_gradients(model: nn.Module) -> None:
    """Every FSDP2 unit of `model` sums its gradients (the sum convention: each rank's loss is its summand)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has neither PREMUL_SUM nor AVG


def fully_shard_on(model: nn.Module, mesh) -> None:
    """FSDP2 on `mesh` (1-D: FSDP; the 2-D data mesh replicate x shard: HSDP), each block a unit, then the root."""
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = logits.float() if logits.dtype == torch.bfloat16 else logits
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)


def summand(logits: torch.Tensor, inputs: dict, ctx) -> torch.Tensor:
    """This rank's summand of the mean next-token cross-entropy: its tokens' sum over the global token count."""
    return token_losses(logits, inputs["targets"]).sum() / (inputs["targets"].numel() * ctx.size("dp") * ctx.size("cp"))


def _inputs(cfg: Config, masked: bool, batch: int, counted: bool):
    def make(gen: torch.Generator) -> dict[str, torch.Tensor]:
        tokens = torch.randint(0, cfg.vocab, (batch, SEQ + 1), generator=gen)
        inputs = {"tokens": tokens[:, :-1].contiguous(), "targets": tokens[:, 1:].contiguous()}
        if masked:  # a loss mask that differs between the sequence's pieces (a prompt, then the response)
            mask = torch.rand(batch, SEQ, generator=gen) < 0.6
            mask[:, : SEQ // 4] = False
            inputs["loss_mask"] = mask
        if counted:  # the step's token count, whole on every rank and micro-batch (Transformers' num_items_in_batch)
            inputs["loss_mask"][1::2, SEQ // 2 :] = False  # odd rows, micro-batch 2 of `microbatches=2`: fewer tokens
            inputs["tokens_in_step"] = inputs["loss_mask"].sum()
        return inputs

    return make


def model_case(
    op: str,
    variant: str,
    where: dict,
    parallelize: Callable,
    loss: Callable,
    cfg: Config = DEFAULT,
    masked: bool = False,
    build_model: Callable = build,
    batch: int = BATCH,
    counted: bool = False,
    **step,
) -> ModelCase:
    """The ModelCase of one side of a pair: `parallelize(model, ctx)`, `loss(logits, inputs, ctx)` (ctx None on one
    device: the whole batch's loss there); `batch` rows; `counted`: the inputs hold `tokens_in_step`, the masked
    tokens' count; `step`: more ModelCase fields (`microbatches`, `hsdp`)."""
    layouts = {"tokens": BATCH_LAYOUT, "targets": BATCH_LAYOUT}
    if masked:
        layouts["loss_mask"] = BATCH_LAYOUT
    return ModelCase(
        op=op,
        case_id=variant,
        build=lambda gen: build_model(cfg, gen),
        parallelize=parallelize,
        make_inputs=_inputs(cfg, masked, batch, counted),
        model_inputs=("tokens",),
        loss=loss,
        input_layouts=layouts,
        loss_layout=Layout(dp=Partial(), cp=Partial()),
        **where,
        **step,
    )
