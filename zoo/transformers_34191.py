"""huggingface/transformers#34191 (October 2024): gradient accumulation normalized each micro-batch's loss by its
own token count.

(x1 / n1 + x2 / n2) / 2 is not (x1 + x2) / (n1 + n2): with accumulation the Trainer's default causal-LM loss took
each micro-batch's mean over its valid tokens and the micro-batches' losses were averaged, so runs with and without
accumulation had different losses and gradients whenever the micro-batches' valid-token counts differed.  Port: the
decoder at dp 2 (FSDP2, the zoo's sum convention: zoo/_llama.py) over two micro-batches (`microbatches=2`: four rows,
each DP rank's two split one row per micro-batch), a loss mask that leaves the micro-batches unequal token counts.
Broken: each micro-batch's masked token-loss sum over its own tokens (counted over the DP ranks, so they agree),
divided by the number of micro-batches; fixed: over every token of the step, the PR's
`num_items_in_batch` (`tokens_in_step`, handed to every micro-batch)."""

from __future__ import annotations

import torch.distributed as dist
from _llama import data_parallel, model_case, token_losses
from _twins import twins, variant

from shardcheck.harness.core.zoo_bug import BROKEN, FIXED, Bug

FAMILY = "transformers_34191"
IMPLEMENTATION = __file__
MICROBATCHES = 2

BUG = Bug(
    thread="huggingface/transformers#34191",
    url="https://github.com/huggingface/transformers/pull/34191",
    title="gradient accumulation averages per-micro-batch mean losses",
    symptom="losses did not match between runs with accumulation toggled on and off (the HF blog 'Fixing "
    "Gradient Accumulation', 2024-10-16); follow-ups #35210, #35438, #37766 for num_items_in_batch",
    time_to_find="the field found it in October 2024 after years of accumulation in the Trainer; fixes "
    "continued into 2025",
    fix="huggingface/transformers PR #34191 (num_items_in_batch)",
    topology="dp=2,cp=1,tp=1",
    names=("the loss",),
    related=("meta-pytorch/torchtune#1875", "huggingface/transformers#35438"),
)


def _masked_sum(logits, inputs):
    return (token_losses(logits, inputs["targets"]) * inputs["loss_mask"]).sum()


def _mean_per_micro_batch(logits, inputs, ctx):
    tokens = inputs["loss_mask"].sum().to(logits.dtype)
    dist.all_reduce(tokens, group=ctx.group("dp"))  # this micro-batch's tokens on every DP rank
    return _masked_sum(logits, inputs) / tokens / MICROBATCHES


def _sum_over_all_tokens(logits, inputs, ctx):
    return _masked_sum(logits, inputs) / inputs["tokens_in_step"]


compute_loss = {BROKEN: _mean_per_micro_batch, FIXED: _sum_over_all_tokens}


def _loss(logits, inputs, ctx):
    if ctx is None:  # one device, the same micro-batches: each one's summand of the step's mean
        return _sum_over_all_tokens(logits, inputs, ctx)
    return ctx.impl.compute_loss[variant(ctx)](logits, inputs, ctx)


def parallelize(model, ctx):
    data_parallel(model, ctx)
    return model


def cases(quick: bool = False) -> list:
    def make(v, where):
        return model_case(
            f"{FAMILY}.compute_loss",
            v,
            where,
            parallelize,
            _loss,
            masked=True,
            batch=4,
            counted=True,
            microbatches=MICROBATCHES,
        )

    return twins(BUG, make)
