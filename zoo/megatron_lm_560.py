"""RoPE under context parallelism without the rank's position offset (Megatron-LM#560 asked whether Megatron's
rotary embedding is right per CP rank).

A context-parallel rank holds two chunks of the sequence (head-tail: chunks r and 2·CP-1-r); its rotary embedding
must rotate them at their global positions (Megatron slices the rotary table per CP rank,
`get_pos_emb_on_this_cp_rank`).  A port that rotates each rank's local sequence at positions 0, 1, ... gives every
CP rank's queries and keys wrong angles while every shape fits.  Port: the decoder at CP 2 under torch's
context_parallel.  Broken: the positions buffer never handed to the attention; fixed: each rank's positions given."""

from __future__ import annotations

from _llama import context_parallel_on, data_parallel, model_case, summand, token_losses
from _twins import twins, variant

from shardcheck.harness.core.zoo_bug import BROKEN, FIXED, Bug

FAMILY = "megatron_lm_560"
IMPLEMENTATION = __file__

BUG = Bug(
    thread="NVIDIA/Megatron-LM#560",
    url="https://github.com/NVIDIA/Megatron-LM/issues/560",
    title="rotary embedding at local positions on each context-parallel rank",
    symptom="a question (2023-10-25): 'I think it needs to have sin and cos values corresponding to each rank'; "
    "Megatron's own code slices the table per rank, a port that does not trains at wrong positions silently",
    time_to_find="the question was closed as stale, unanswered",
    fix="the rank's positions (Megatron: get_pos_emb_on_this_cp_rank; torch: the positions as a CP buffer)",
    topology="dp=1,cp=2,tp=1",
    names=("rope",),
    related=("NVIDIA/Megatron-LM#453",),
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
