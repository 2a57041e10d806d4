"""Megatron-LM PR #5956 (#5656): under expert parallelism Megatron-FSDP v2 left expert gradients ep_size times
too large.

A rank's experts already sum the gradients of tokens routed from every rank of the EP group; mFSDP then averaged over
the expert-data-parallel mesh (size dp), dividing by dp where world_size ranks contributed.  MCore DDP corrects it
with expert_gradient_scaling_factor = expt_dp / dp.  NEEDS the `ep` axis and the MoE family (issue 39, r-moe); the
pair: a two-expert MoE layer at EP 2, broken without the factor, fixed with it."""

from __future__ import annotations

from _pending import pending

from shardcheck.harness.core.zoo_bug import Bug, Capability

FAMILY = "megatron_lm_5956"
IMPLEMENTATION = __file__

BUG = Bug(
    thread="NVIDIA/Megatron-LM PR #5956",
    url="https://github.com/NVIDIA/Megatron-LM/pull/5956",
    title="expert gradients not divided by the expert-parallel size",
    symptom="expert gradients ep_size times too large under Megatron-FSDP v2 with EP",
    time_to_find="issue #5656; the fix's first revision claimed no change was needed; merged 2026-07",
    fix="NVIDIA/Megatron-LM PR #5956 (grad_divisor)",
    topology="dp=2,cp=1,tp=1",
    names=("experts",),
    related=("NVIDIA/Megatron-LM#5656", "pytorch/pytorch#167178"),
    needs=Capability.EP_AXIS,
)


def cases(quick: bool = False) -> list:
    return pending(BUG)
