"""Megatron-LM#1446: with TP and sequence parallelism the final layernorm's gradient differs between TP ranks.

Under sequence parallelism each TP rank normalizes only its shard of the sequence, so a norm weight's gradient holds
only its tokens' part; finalize_model_grads all-reduces the gradients of parameters tagged `sequence_parallel` over
TP, and the final layernorm's were not (its main_grad differed on every TP rank before optimizer.step()).  Port: the
decoder under TP 2 with sequence parallelism.  Broken: the final norm left a plain replicated weight (no sequence
parallel style: nothing reduces its gradient over TP); fixed: SequenceParallel on it as on the layers' norms (its
DTensor gradient is reduced over TP)."""

from __future__ import annotations

from _llama import model_case, tensor_parallel, token_losses
from _twins import twins, variant

from shardcheck.harness.core.zoo_bug import BROKEN, FIXED, Bug

FAMILY = "megatron_lm_1446"
IMPLEMENTATION = __file__

BUG = Bug(
    thread="NVIDIA/Megatron-LM#1446",
    url="https://github.com/NVIDIA/Megatron-LM/issues/1446",
    title="final_layernorm's gradient is not all-reduced over TP under sequence parallelism",
    symptom="final_layernorm.weight.main_grad differs on every TP rank before optimizer.step(), so the replicas drift",
    time_to_find="reported 2025-03-04, closed (the all-reduce of sequence-parallel norm gradients is "
    "finalize_model_grads' job; TransformerEngine#435 asked the same in 2023)",
    fix="tag the final norm's parameters sequence_parallel so finalize_model_grads all-reduces them",
    topology="dp=1,cp=1,tp=2",
    names=("norm.weight",),
    related=("NVIDIA/TransformerEngine#435", "NVIDIA/Megatron-LM#443"),
)


def _final_norm_untagged(model, ctx):
    tensor_parallel(model, ctx.mesh["tp"], final_norm=False)
    return model


def _final_norm_sequence_parallel(model, ctx):
    tensor_parallel(model, ctx.mesh["tp"])
    return model


parallelize = {BROKEN: _final_norm_untagged, FIXED: _final_norm_sequence_parallel}


def _loss(logits, inputs, ctx):
    return token_losses(logits, inputs["targets"]).mean()


def cases(quick: bool = False) -> list:
    return twins(
        BUG,
        lambda v, where: model_case(
            f"{FAMILY}.parallelize", v, where, lambda model, ctx: ctx.impl.parallelize[variant(ctx)](model, ctx), _loss
        ),
    )
