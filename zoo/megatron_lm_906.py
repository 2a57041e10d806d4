"""Megatron-LM#906 (after #673): with context parallelism the loss is multiplied by cp_size, and the gradients are
averaged over the data-parallel group without CP, so they come out cp_size times too large.

pretrain_gpt.py's `loss_func` returned `loss * args.context_parallel_size` (#673 argued it was compensated by
averaging the gradients over DP x CP; #906 found the code averaging over DP only).  Port, in the sum convention (each
rank's loss its summand of the global mean, gradients summed over dp x cp by FSDP2): the decoder at CP 2.  Broken:
each rank's summand times cp_size (what the two scalings left); fixed: the summand alone (commit 3bdcbbb removed
the scaling)."""

from __future__ import annotations

from _llama import context_parallel_on, data_parallel, model_case, summand, token_losses
from _twins import twins, variant

from shardcheck.harness.core.zoo_bug import BROKEN, FIXED, Bug

FAMILY = "megatron_lm_906"
IMPLEMENTATION = __file__

BUG = Bug(
    thread="NVIDIA/Megatron-LM#906",
    url="https://github.com/NVIDIA/Megatron-LM/issues/906",
    title="loss multiplied by cp_size while the gradients are averaged over DP only",
    symptom="dp2cp4 and dp8 with the same global batch give different gradients (grad_data after the all-reduce)",
    time_to_find="#673 raised the CP loss scaling on 2024-01-23; #906 (2024-07-07) found the mismatch, fixed in "
    "commit 3bdcbbb by 2024-09-19: 8 months from the first report",
    fix="NVIDIA/Megatron-LM commit 3bdcbbbe5d2a455a75e28969be7250cd4bd27bae",
    topology="dp=1,cp=2,tp=1",
    names=("the loss",),
    related=("NVIDIA/Megatron-LM#673",),
)


def _loss_times_cp(logits, inputs, ctx):
    return summand(logits, inputs, ctx) * ctx.size("cp")


loss_func = {BROKEN: _loss_times_cp, FIXED: summand}


def parallelize(model, ctx):
    context_parallel_on(model, ctx)
    data_parallel(model, ctx)
    return model


def _loss(logits, inputs, ctx):
    if ctx is None:
        return token_losses(logits, inputs["targets"]).mean()
    return ctx.impl.loss_func[variant(ctx)](logits, inputs, ctx)


def cases(quick: bool = False) -> list:
    return twins(BUG, lambda v, where: model_case(f"{FAMILY}.loss_func", v, where, parallelize, _loss))
