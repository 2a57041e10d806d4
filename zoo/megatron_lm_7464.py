"""Megatron-LM#7464 (and #737): label smoothing in the vocab-parallel cross-entropy over the local vocabulary.

With label_smoothing > 0, `vocab_parallel_cross_entropy` takes `vocab_size = exp_logits.size(-1)` (this rank's
partition) for the smoothing coefficient and `log_probs.mean(dim=-1)` over its partition only, and the backward
carries the same local vocabulary size: the loss differs between TP ranks and from TP 1, and so do the gradients.
Port: smoothing 0.1 over a 16-token vocabulary at TP 2.  Broken: Megatron's code; fixed: the global vocabulary size
and the mean log-probability all-reduced over TP (the fix of PR #7466 / #5522).  Named right: the loss and the
gradient (`forward`, `grad:logits`) and no more: the smoothing term is wrong on every token of every TP rank and
the gradient on every column, so the worst element and rank are only where the random logits put the largest
error, not a place the fix touched."""

from __future__ import annotations

from _ce_case import ce_case
from _twins import twins, variant
from _vocab_ce import cross_entropy, vocab_parallel_cross_entropy

from shardcheck.harness.core.zoo_bug import BROKEN, FIXED, Bug

FAMILY = "megatron_lm_7464"
IMPLEMENTATION = __file__

BUG = Bug(
    thread="NVIDIA/Megatron-LM#7464",
    url="https://github.com/NVIDIA/Megatron-LM/issues/7464",
    title="label smoothing uses the local vocabulary size and the local mean log-probability",
    symptom="with TP > 1 and label_smoothing > 0 the loss differs between TP ranks and from TP 1; wrong gradients",
    time_to_find="reported as #737 on 2024-03-14; still open 2.5 years later (#7464, 2026-09-18)",
    fix="open: PR #7466 (after the closed PR #5522): global vocabulary size and global mean log-probability",
    topology="dp=1,cp=1,tp=2",
    names=("forward",),
    related=("NVIDIA/Megatron-LM#737", "NVIDIA/Megatron-LM#5522", "NVIDIA/Megatron-LM#7466"),
)

VOCAB, SMOOTHING = 16, 0.1


def _local_smoothing(logits, target, group):
    return vocab_parallel_cross_entropy(logits, target, group, SMOOTHING, global_smoothing=False)


def _global_smoothing(logits, target, group):
    return vocab_parallel_cross_entropy(logits, target, group, SMOOTHING, global_smoothing=True)


vocab_parallel_cross_entropy_smoothed = {BROKEN: _local_smoothing, FIXED: _global_smoothing}


def _reference(inputs):
    return cross_entropy(inputs["logits"], inputs["target"], SMOOTHING)


def _run(impl, ctx, inputs):
    return impl.vocab_parallel_cross_entropy_smoothed[variant(ctx)](inputs["logits"], inputs["target"], ctx.group("tp"))


def cases(quick: bool = False) -> list:
    op = f"{FAMILY}.vocab_parallel_cross_entropy_smoothed"
    return twins(BUG, lambda v, where: ce_case(op, v, where, VOCAB, _reference, _run))
