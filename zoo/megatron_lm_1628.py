"""Megatron-LM#1628: expert tensor parallelism's gradient synchronization.

With expert tensor parallelism (ETP) different from TP, expert parameters must be reduced over the expert groups
(EP, ETP, EDP) and dense ones over TP/DP; a parameter routed through the wrong group has its gradient scrambled or
counted the wrong number of times (the same family as PRs #5916, #6080, #6165).  NEEDS the `ep` axis and the MoE
family (issue 39, r-moe)."""

from __future__ import annotations

from _pending import pending

from shardcheck.harness.core.zoo_bug import Bug, Capability

FAMILY = "megatron_lm_1628"
IMPLEMENTATION = __file__

BUG = Bug(
    thread="NVIDIA/Megatron-LM#1628",
    url="https://github.com/NVIDIA/Megatron-LM/issues/1628",
    title="expert-TP gradient synchronization",
    symptom="expert gradients reduced over the wrong group (thread not in the search index used here; the related "
    "PRs #6080 and #6165 report scrambled expert gradients and parameter-norm failures)",
    time_to_find="not read here (the thread is not in the search index)",
    fix="related: NVIDIA/Megatron-LM PRs #5916, #6080, #6165",
    topology="dp=2,cp=1,tp=2",
    names=("experts",),
    related=("NVIDIA/Megatron-LM#6080", "NVIDIA/Megatron-LM#6165"),
    needs=Capability.EP_AXIS,
)


def cases(quick: bool = False) -> list:
    return pending(BUG)
