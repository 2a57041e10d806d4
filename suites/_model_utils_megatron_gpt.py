"""model_utils_megatron suite: the tiny Megatron-Core GPTModel as a model case (shardcheck.ModelCase).

One training step of the GPTModel of suites/_megatron_model.py (2 layers, hidden 64, 4 heads, vocab 128, S 16, RoPE)
at TP 1, 2, 4 with sequence parallelism at TP > 1, GPTModel.forward patched by the module under test
(`patch_gpt_model_forward_for_linear_ce_fusion`, the flag off: Megatron's own forward, as NeMo-RL runs it for
anything but the fused log-probs), against the same model on one device: every module's output and the gradient at
it, the loss, every parameter's gradient and every parameter after one SGD step, in float64, float32 and bfloat16.

The plan is Megatron's own: `parallelize` builds the TP-sharded GPTModel over the mesh's "tp" group (through a
ProcessGroupCollection, parallel_state untouched) and the harness puts the single-device weights into it by the
`PARAM_LAYOUTS` globs.  Megatron's finalize_model_grads all-reduces over TP the gradients of the parameters it tags
`sequence_parallel` (norms and row-parallel biases, used on a sequence shard); its stand-in here is a
post-accumulate-grad hook on each of them (`sync_sp_grads`;
tests/broken/model_utils_megatron/sp_norm_grad_not_reduced.py leaves it out and is caught at the norm's gradient and its
stepped value).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from shardcheck import REPLICATED, Layout, ModelCase, Shard
from shardcheck.harness.core.restore import owners_of, restored
from shardcheck.suites._megatron_model import (
    BATCH,
    HEADS,
    ONE_RANK,
    SEQ,
    VOCAB,
    build_model,
    make_params,
    megatron_missing,
    megatron_shims,
    model_args,
)

FORWARD_OP = "model_utils._gpt_forward_with_linear_ce_fusion"
COLUMN, ROW, SEQUENCE = Layout(tp=Shard(0)), Layout(tp=Shard(1)), Layout(tp=Shard(0))

# The single-device weights into the TP model: column-parallel (and vocab) rows, row-parallel columns; norms and
# row-parallel biases replicated (no glob).
PARAM_LAYOUTS = {
    "embedding.word_embeddings.weight": COLUMN,
    "output_layer.weight": COLUMN,
    "*.linear_qkv.weight": COLUMN,
    "*.linear_qkv.bias": COLUMN,
    "*.linear_fc1.weight": COLUMN,
    "*.linear_fc1.bias": COLUMN,
    "*.linear_proj.weight": ROW,
    "*.linear_fc2.weight": ROW,
}
# Megatron keeps activations [S, B, H]; under sequence parallelism every one of them is a sequence shard (dim 0): the
# embedding's, the norms', the attention's and the MLP's outputs after the row-parallel reduce-scatter, the layers'.
# The column-parallel ones are split on their last dim (the fused q/k/v and fc1 outputs, the core attention's
# [S, B, heads/TP * d]), q and k by head [S, B, heads/TP, d], the attention probabilities by head [B, heads/TP, S, S],
# the logits [B, S, V/TP] by vocabulary; the rotary table is whole.  The first glob that matches a module path wins
# (`*` spans dots): the exceptions first, then the rule.  At TP 1 each is the whole tensor.
ACTIVATION_LAYOUTS = {
    "rotary_pos_emb": REPLICATED,
    "*.self_attention.linear_qkv": Layout(tp=Shard(-1)),
    "*.mlp.linear_fc1": Layout(tp=Shard(-1)),
    "*.self_attention.q_layernorm": Layout(tp=Shard(2)),
    "*.self_attention.k_layernorm": Layout(tp=Shard(2)),
    "*.core_attention.scale_mask_softmax": Layout(tp=Shard(1)),
    "*.core_attention.attention_dropout": Layout(tp=Shard(1)),
    "*.core_attention": Layout(tp=Shard(-1)),
    "output_layer": Layout(tp=Shard(-1)),
    "": Layout(tp=Shard(-1)),
    "*": SEQUENCE,
}

# Under sequence parallelism Megatron's vocab-parallel embedding reduce-scatters its output as [S/TP, B, H]; without
# it returns [B, S, H] and the embedding module transposes: the same values in another order, compared at `embedding`.
UNCHECKED = ("embedding.word_embeddings",)


def supports(t) -> bool:
    """TP only (Megatron's DP and CP are not this model's plan), dividing the sequence, the vocabulary and the heads."""
    return t.dp == 1 and t.cp == 1 and SEQ % t.tp == 0 and VOCAB % t.tp == 0 and HEADS % t.tp == 0


def make_inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """input_ids and next-token labels [B, S], with Megatron's position ids and boolean causal mask."""
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    ids, positions, mask = model_args(tokens[:, :-1].contiguous())
    return {
        "input_ids": ids,
        "position_ids": positions.contiguous(),
        "attention_mask": mask,
        "labels": tokens[:, 1:].contiguous(),
    }


def build(tied: bool):
    def full_model(gen: torch.Generator) -> torch.nn.Module:
        """The single-device GPTModel (float64 config; the harness casts it), weights drawn from `gen`."""
        model = build_model(tied, ONE_RANK, torch.float64, torch.device("cpu"), cache=False)
        # Megatron's layers fall back to parallel_state's group where torch.distributed is not initialised (the
        # driver lists the cases, running this model once): at TP 1 each only asks the group's size and rank.
        for module in model.modules():
            if hasattr(module, "tp_group") and module.tp_group is None:
                module.tp_group = ONE_RANK
        weights = make_params(gen, tied)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(weights[name])
        return model

    return full_model


def _all_reduce_grad(group):
    def hook(p: torch.Tensor) -> None:
        dist.all_reduce(p.grad, group=group)

    return hook


def parallelize(tied: bool, sync_sp_grads: bool = True):
    def plan(model: torch.nn.Module, ctx) -> torch.nn.Module:
        """This rank's TP-sharded GPTModel (sequence parallel at TP > 1), built as the single-device one is and cast
        to its dtype; the sequence-parallel-tagged gradients summed over TP as Megatron's finalize_model_grads does."""
        tp = ctx.group("tp")
        dtype = next(model.parameters()).dtype
        sharded = build_model(tied, tp, torch.float64, ctx.device, cache=False).to(dtype)
        if sync_sp_grads and tp.size() > 1:
            for p in sharded.parameters():
                if getattr(p, "sequence_parallel", False):
                    p.register_post_accumulate_grad_hook(_all_reduce_grad(tp))
        return sharded

    return plan


def loss(logits: torch.Tensor, inputs: dict, ctx) -> torch.Tensor:
    """Mean next-token cross-entropy (float32 at least) on the whole vocabulary: a rank's [B, S, V/TP] logits are
    gathered over TP first (DTensor.full_tensor; its backward gives each rank its vocabulary slice of the gradient).
    Not Megatron's vocab_parallel_cross_entropy: that one computes in float32 whatever the logits' dtype, which would
    put a float32 error into every float64 check after it."""
    if ctx is not None:
        logits = DTensor.from_local(logits, ctx.mesh["tp"], [Shard(2)]).full_tensor()
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.flatten(0, 1), inputs["labels"].flatten())


@contextlib.contextmanager
def patched_forward(impl, chunk_size: int, twice: bool = False):
    """GPTModel.forward patched by the module under test for the block, then everything the patch changed undone:
    the class, and the module's own markers (an "already patched" flag in its globals or on the patch function,
    which would otherwise make the next case's patch call a no-op on the restored class).  Other cases see the
    original.  `twice`: patched first with chunk_size 1, then with `chunk_size` (the second call must only update
    it)."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    patch = impl.patch_gpt_model_forward_for_linear_ce_fusion
    original = GPTModel.forward
    with restored(GPTModel, impl, *owners_of(patch)):
        if twice:
            patch(chunk_size=1)
        patch(chunk_size=chunk_size)
        yield original


def step_context(ctx):
    """Megatron's CPU shims (its TP group for the loss), and on a rank GPTModel.forward patched by the module under
    test, undone after the step."""
    stack = contextlib.ExitStack()
    device = torch.device("cpu") if ctx is None else ctx.device
    stack.enter_context(megatron_shims(device, None if ctx is None else ctx.group("tp")))
    if ctx is not None:
        stack.enter_context(patched_forward(ctx.impl, 4))
    return stack


def gpt_model_case(tied: bool, sync_sp_grads: bool = True, case_id: str | None = None) -> ModelCase:
    return ModelCase(
        op=FORWARD_OP,
        case_id=case_id or f"model-{'tied' if tied else 'untied'}",
        build=build(tied),
        parallelize=parallelize(tied, sync_sp_grads),
        make_inputs=make_inputs,
        model_inputs=("input_ids", "position_ids", "attention_mask"),
        loss=loss,
        step_context=step_context,
        param_layouts=PARAM_LAYOUTS,
        activation_layouts=ACTIVATION_LAYOUTS,
        unchecked_modules=UNCHECKED,
        batch="input_ids",
        supports=supports,
        skip_reason=megatron_missing(),
        params={"tied": tied, "S": SEQ, "B": BATCH, "V": VOCAB},
    )
