"""Megatron-LM PR #5956 (issue #5656): Megatron-FSDP v2's `fully_shard` left expert gradients ep_size times too large.

The PR: a rank's experts see the tokens routed to them from every rank of its expert-parallel group, so its expert
gradient already sums ep_size ranks' data before any collective; mFSDP then reduce-scattered with ReduceOp.AVG over
the mesh it was handed, for the experts the expert-DP mesh, dividing by its size where world_size ranks contributed.
Dense parameters were right (one contribution per rank of the full DP mesh).  MCore DDP corrects it with
expert_gradient_scaling_factor = expt_dp / dp; the fix adds `grad_divisor` (ep_size) to mFSDP v2.  An earlier
revision of the PR claimed no change was needed.

Port: the MoE decoder (reference/moe.py) at dp 4 = edp 2 x ep 2, every gradient averaged over its mesh as mFSDP does
(the dense ones over dp, the experts' over edp), in the harness's sum convention (`parallelize`).  Broken: the
experts divided by edp alone; fixed: by edp x grad_divisor (ep)."""

from __future__ import annotations

from _moe import is_expert, model_case, reduce_grads, shard
from _twins import twins, variant

from shardcheck.distributed_impl import moe as ours
from shardcheck.harness.core.zoo_bug import BROKEN, FIXED, Bug
from shardcheck.suites.moe import CONFIG

FAMILY = "megatron_lm_5956"
IMPLEMENTATION = __file__

BUG = Bug(
    thread="NVIDIA/Megatron-LM PR #5956",
    url="https://github.com/NVIDIA/Megatron-LM/pull/5956",
    title="expert gradients not divided by the expert-parallel size",
    symptom="expert gradients ep_size times too large under Megatron-FSDP v2 with EP (dense ones right)",
    time_to_find="issue #5656; the PR (2026-07-22) first claimed no library change was needed, then measured the "
    "ep_size factor with its unit test; merged",
    fix="NVIDIA/Megatron-LM PR #5956 (grad_divisor); the MCore adapter in PR #6450",
    topology="dp=4,cp=1,tp=1,ep=2",
    names=("experts",),
    related=("NVIDIA/Megatron-LM#5656", "NVIDIA/Megatron-LM#6450", "pytorch/pytorch#167178"),
)


def _average_over_expert_dp(ctx) -> float:
    """Before the fix: ReduceOp.AVG over the expert-DP mesh, nothing more."""
    return 1.0


def _ep_size(ctx) -> float:
    return float(ctx.size("ep"))


grad_divisor = {BROKEN: _average_over_expert_dp, FIXED: _ep_size}


def parallelize(model, ctx):
    """Every gradient averaged over its mesh, as mFSDP's AVG: written in the harness's sum convention (each rank's
    loss its summand of the batch's mean, the rank's own mean's gradient dp times it), an average over n ranks of
    own-mean gradients is the sum of the summands' times dp / n."""
    shard(model, ctx)
    dp, edp = ctx.size("dp"), ctx.size("edp")
    divisor = edp * ctx.impl.grad_divisor[variant(ctx)](ctx)  # the expert-DP mesh's AVG, then grad_divisor
    dense = ([ctx.group("dp")] if dp > 1 else [], 1.0)  # the AVG over all dp: dp / dp
    experts = (ours.expert_grad_groups(ctx), divisor / dp)  # summed over edp, times dp / divisor
    reduce_grads(model, lambda name: experts if is_expert(name) else dense)
    return model


def loss(outputs, tokens, ctx):
    """Each rank's summand of the whole batch's loss (its value the batch's)."""
    return ours.loss(outputs, tokens, ctx, CONFIG.aux_coef)


def cases(quick: bool = False) -> list:
    return twins(BUG, lambda v, where: model_case(f"{FAMILY}.grad_divisor", v, where))
