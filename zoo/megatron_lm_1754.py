"""Megatron-LM#1754: the vocab-parallel cross-entropy counts the padded vocabulary's logits in its softmax.

Megatron pads the vocabulary to a multiple of make-vocab-size-divisible-by x TP; the output layer computes logits
for the padding rows too, and `vocab_parallel_cross_entropy` normalizes over every column it holds.  At TP 1 with
`--make-vocab-size-divisible-by 1` nothing is padded; at TP 2 the last rank holds padding columns, and the loss
leaves the TP 1 one.  Port: the logits of a 30-token vocabulary padded to 32 (16 per rank at TP 2), the loss held to
the cross-entropy over the 30 real tokens.  Broken: Megatron's function as it is; fixed: the padding columns masked
to -inf before the softmax (the thread's proposal).  Named right: the loss and the gradient (`forward`,
`grad:logits`), the worst gradient element a padded column's on the last TP rank, which must be 0 (`shows`)."""

from __future__ import annotations

from _ce_case import ce_case
from _twins import twins, variant
from _vocab_ce import cross_entropy, vocab_parallel_cross_entropy

from shardcheck.harness.core.zoo_bug import BROKEN, FIXED, Bug

FAMILY = "megatron_lm_1754"
IMPLEMENTATION = __file__

BUG = Bug(
    thread="NVIDIA/Megatron-LM#1754",
    url="https://github.com/NVIDIA/Megatron-LM/issues/1754",
    title="vocab-parallel cross-entropy normalizes over the padded vocabulary's logits",
    symptom="TP 2 loss diverges from single-GPU loss when the vocabulary (50257) is not divisible by TP: "
    "absolute error 47.1 (over 50 %) after 2000 steps",
    time_to_find="open since 2025-08-19 (no fix merged); the same root was suspected in bionemo-recipes#631 "
    "seven months earlier",
    fix="open: mask the padded logits out of the softmax (proposed in the thread)",
    topology="dp=1,cp=1,tp=2",
    names=("forward",),
    # the worst gradient is a padded column's (30 or 31, on the last TP rank), where the right one is 0
    shows={"grad:logits": r"^rank 1 \(.*tp=1\): .* at global \(\d+, \d+, 3[01]\) .*: expected 0, "},
    related=("NVIDIA-BioNeMo/bionemo-recipes#631",),
)

VOCAB, PADDED = 30, 32


def _as_megatron_had_it(logits, target, group):
    return vocab_parallel_cross_entropy(logits, target, group)


def _padding_masked(logits, target, group):
    return vocab_parallel_cross_entropy(logits, target, group, real_vocab=VOCAB)


# the op under test: each variant of the function, by the case's variant
vocab_parallel_cross_entropy_padded = {BROKEN: _as_megatron_had_it, FIXED: _padding_masked}


def _reference(inputs):
    return cross_entropy(inputs["logits"][..., :VOCAB], inputs["target"])


def _run(impl, ctx, inputs):
    fn = impl.vocab_parallel_cross_entropy_padded[variant(ctx)]
    return fn(inputs["logits"], inputs["target"], ctx.group("tp"))


def cases(quick: bool = False) -> list:
    op = f"{FAMILY}.vocab_parallel_cross_entropy_padded"
    return twins(BUG, lambda v, where: ce_case(op, v, where, PADDED, _reference, _run, target_vocab=VOCAB))
