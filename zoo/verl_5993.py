"""verl-project/verl#5993 (#5983): with CP > 1 the token-mean loss divides by a token count summed over DP only.

verl's Megatron engine path counts `batch_num_tokens`, the denominator of loss_agg_mode="token-mean", over the pure
data-parallel group; each CP rank holds 1/CP of the sequence, so the count falls CP times short and the loss and
its gradients come out CP times too large.  Port: the decoder at CP 2 under torch's context_parallel and FSDP2
(gradients summed over dp x cp).  Broken: each rank's token-loss sum over the count all-reduced over dp; fixed:
over dp x cp (the PR's get_data_parallel_group(with_context_parallel=True))."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _llama import context_parallel_on, data_parallel, model_case, token_losses
from _twins import twins, variant

from shardcheck.harness.core.zoo_bug import BROKEN, FIXED, Bug

FAMILY = "verl_5993"
IMPLEMENTATION = __file__

BUG = Bug(
    thread="verl-project/verl#5993",
    url="https://github.com/verl-project/verl/pull/5993",
    title="token-mean normalization counts the tokens over DP only under CP",
    symptom="CP > 1: the valid-token count undercounted by a factor CP, token-mean loss normalization wrong",
    time_to_find="issue #5983, PR #5993 (2026-04-13), closed; related to #4852 and #1332",
    fix="verl-project/verl PR #5993: batch_num_tokens reduced over DP x CP",
    topology="dp=1,cp=2,tp=1",
    names=("the loss",),
    related=("verl-project/verl#5983",),
)


def _tokens_over(group, targets):
    count = torch.tensor(float(targets.numel()), dtype=torch.float64)
    dist.all_reduce(count, group=group)
    return count


def _count_over_dp(logits, inputs, ctx):
    loss = token_losses(logits, inputs["targets"]).sum()
    return loss / _tokens_over(ctx.group("dp"), inputs["targets"]).to(loss.dtype)


def _count_over_dp_cp(logits, inputs, ctx):
    loss = token_losses(logits, inputs["targets"]).sum()
    group = ctx.mesh["dp", "cp"]._flatten("dp_cp").get_group()
    return loss / _tokens_over(group, inputs["targets"]).to(loss.dtype)


loss_func = {BROKEN: _count_over_dp, FIXED: _count_over_dp_cp}


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
