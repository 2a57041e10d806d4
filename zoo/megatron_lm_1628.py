"""Megatron-LM#1628 (PR #1622): with MoE parallel folding, expert-TP > 1 and EP = 1 synchronized the experts'
gradients over the dense data-parallel group.

The thread: tp 1 / ep 4 / etp 1 against tp 1 / ep 1 / etp 4 on 8 GPUs (the same checkpoint), the second's loss curve
"bad".  Megatron's DDP put a parameter in the expert buffers (all-reduced over expert-DP) only when it was tagged
`allreduce=False`, which the expert linears set only at EP > 1; at EP = 1 with ETP != TP they stayed dense
parameters and `finish_grad_sync` all-reduced them over the dense DP group, which holds the ETP ranks: each ETP rank
holds a different slice of the expert's hidden dim, so the sum mixed the slices.  PR #1622 (and later #5916:
`use_expert_pgs = EP > 1 or ETP != TP`) tags them expert parameters at ETP != TP too.

Port: the MoE decoder (reference/moe.py) at dp 2 x tp 2 with EP 1, the family's expert-TP on the tp dim and the
dense weights replicated over it, as at the thread's TP 1: the ETP ranks are then ranks of the dense DP group (dp x
tp).  Broken: the experts reduced as dense parameters, over dp and tp; fixed: over their expert-DP group (edp, dp at
EP 1).  The dense gradients are the same in both (over dp: the tp ranks see the same tokens)."""

from __future__ import annotations

from _moe import is_expert, model_case, reduce_grads, shard
from _twins import twins, variant

from shardcheck.distributed_impl import moe as ours
from shardcheck.harness.core.zoo_bug import BROKEN, FIXED, Bug
from shardcheck.suites.moe import CONFIG

FAMILY = "megatron_lm_1628"
IMPLEMENTATION = __file__

BUG = Bug(
    thread="NVIDIA/Megatron-LM#1628",
    url="https://github.com/NVIDIA/Megatron-LM/issues/1628",
    title="expert-TP > 1 with EP = 1: expert gradients synchronized over the dense data-parallel group",
    symptom="the loss curve of tp1/ep1/etp4 departs from tp1/ep4/etp1's on the same checkpoint (8 GPUs, 8 experts)",
    time_to_find="fix proposed by the reporter 2025-06-10 (PR #1622), issue 2025-06-13; PR left open, the same "
    "condition fixed in NVIDIA/Megatron-LM PR #5916 (2026-07)",
    fix="NVIDIA/Megatron-LM PR #1622 (open); merged as PR #5916 (use_expert_pgs = EP > 1 or ETP != TP)",
    topology="dp=2,cp=1,tp=2",
    names=("experts",),
    related=("NVIDIA/Megatron-LM#1622", "NVIDIA/Megatron-LM#5916", "NVIDIA/Megatron-LM#6080"),
)


def _as_dense(ctx) -> list:
    """Before the fix: at EP = 1 the experts are dense parameters, reduced over the dense DP group, which holds the
    ETP ranks (here dp x tp)."""
    return [ctx.group(d) for d in ("dp", "tp") if ctx.size(d) > 1]


def _over_expert_dp(ctx) -> list:
    """The fix: tagged expert parameters, reduced over their expert-DP group (the ranks holding the same slice)."""
    return ours.expert_grad_groups(ctx)


expert_grad_groups = {BROKEN: _as_dense, FIXED: _over_expert_dp}


def parallelize(model, ctx):
    shard(model, ctx)
    experts = ctx.impl.expert_grad_groups[variant(ctx)](ctx)
    # the dense weights see the same tokens on every tp rank (tp replicates the batch): their sync is over dp alone
    dense = [ctx.group("dp")] if ctx.size("dp") > 1 else []
    reduce_grads(model, lambda name: (experts, 1.0) if is_expert(name) else (dense, 1.0))
    return model


def loss(outputs, tokens, ctx):
    """Each rank's summand of the whole batch's loss (the family's convention: gradients summed, not averaged)."""
    return ours.loss(outputs, tokens, ctx, CONFIG.aux_coef)


def cases(quick: bool = False) -> list:
    return twins(BUG, lambda v, where: model_case(f"{FAMILY}.expert_grad_groups", v, where))
