"""NVIDIA-NeMo/Automodel#2377: the rotary embedding ignores the values of position_ids (RoPE without the CP offset).

Automodel's `LlamaRotaryEmbedding.forward` keyed only on `position_ids.shape[-1]` and returned `cos_cache[:seq_len]`:
any position_ids that are not a plain arange(seq_len) got the wrong rotary phase silently, a context-parallel
rank's above all.  A CP rank holds two chunks of the sequence (head-tail: chunks r and 2·CP-1-r) and must rotate them
at their global positions (Megatron slices its table per CP rank, `get_pos_emb_on_this_cp_rank`; Megatron-LM#560
asked whether that was right); rotated at 0, 1, ... of its local sequence, every shape fits and every angle is
wrong.  Port: the decoder at CP 2 under torch's
context_parallel.  Broken: the positions buffer never handed to the attention; fixed: each rank's positions given."""

from __future__ import annotations

from _llama import context_parallel_on, data_parallel, model_case, summand, token_losses
from _twins import twins, variant

from shardcheck.harness.core.zoo_bug import BROKEN, FIXED, Bug

FAMILY = "automodel_2377"
IMPLEMENTATION = __file__

BUG = Bug(
    thread="NVIDIA-NeMo/Automodel#2377",
    url="https://github.com/NVIDIA-NeMo/Automodel/pull/2377",
    title="rotary embedding at positions 0..S-1 whatever position_ids says (RoPE without the CP offset)",
    symptom="any non-contiguous position_ids (EAGLE test-time-training offsets, packed or context-parallel "
    "sequences) received the wrong rotary phase, silently",
    time_to_find="fixed by PR #2377 (2026-06-01, merged); Megatron-LM#560 had asked about RoPE per CP rank in 2023",
    fix="NVIDIA-NeMo/Automodel PR #2377: gather cos/sin by the position values",
    topology="dp=1,cp=2,tp=1",
    names=("rope",),
    related=("NVIDIA/Megatron-LM#560", "NVIDIA/Megatron-LM#453"),
)


def _local_positions(model, ctx):
    context_parallel_on(model, ctx, offsets=False)
    data_parallel(model, ctx)
    return model


def _global_positions(model, ctx):
    context_parallel_on(model, ctx)
    data_parallel(model, ctx)
    return model


parallelize = {BROKEN: _local_positions, FIXED: _global_positions}


def _loss(logits, inputs, ctx):
    return token_losses(logits, inputs["targets"]).mean() if ctx is None else summand(logits, inputs, ctx)


def cases(quick: bool = False) -> list:
    return twins(
        BUG,
        lambda v, where: model_case(
            f"{FAMILY}.parallelize", v, where, lambda model, ctx: ctx.impl.parallelize[variant(ctx)](model, ctx), _loss
        ),
    )
