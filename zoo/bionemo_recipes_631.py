"""bionemo-recipes#631: ESM-2's masked-language-model loss at TP 2 counts the padded vocabulary in its softmax.

BioNeMo pads ESM-2's 33-token vocabulary (make_vocab_size_divisible_by=128) and `unreduced_token_loss_fn` calls
Megatron's `vocab_parallel_cross_entropy` on every column, padding included, so the TP 2 loss sits a nearly
constant offset above the TP 1 one.  Port: a 33-token vocabulary padded to 48 (24 per rank at TP 2), a third of the
labels -100 (not masked for prediction: not counted), the loss held to the cross-entropy over the 33 real tokens.
Broken: the padding counted; fixed: masked out of the softmax.  Named right: the loss and the gradient, the worst
gradient element a padded column's on the last TP rank, which must be 0 (`shows`)."""

from __future__ import annotations

from _ce_case import ce_case
from _twins import twins, variant
from _vocab_ce import cross_entropy, vocab_parallel_cross_entropy

from shardcheck.harness.core.zoo_bug import BROKEN, FIXED, Bug

FAMILY = "bionemo_recipes_631"
IMPLEMENTATION = __file__

BUG = Bug(
    thread="NVIDIA-BioNeMo/bionemo-recipes#631",
    url="https://github.com/NVIDIA-BioNeMo/bionemo-recipes/pull/631",
    title="ESM-2 token loss at TP 2 includes the padded vocabulary's logits",
    symptom="loss disagreement between TP 1 and TP 2 on the same logits: a nearly constant offset in the training "
    "curve that slowly shrinks over 100 steps, grad_norm unaffected",
    time_to_find="filed 2025-01-22 as a suspected root cause; the pull request is still open",
    fix="open (bionemo-recipes#631): ignore the padded vocabulary in the loss",
    topology="dp=1,cp=1,tp=2",
    names=("forward",),
    # the worst gradient is a padded column's (33 to 47, on the last TP rank), where the right one is 0
    shows={"grad:logits": r"^rank 1 \(.*tp=1\): .* at global \(\d+, \d+, (3[3-9]|4[0-7])\) .*: expected 0, "},
    related=("NVIDIA/Megatron-LM#1754",),
)

VOCAB, PADDED = 33, 48


def _unreduced_token_loss(logits, target, group):
    return vocab_parallel_cross_entropy(logits, target, group)


def _padding_ignored(logits, target, group):
    return vocab_parallel_cross_entropy(logits, target, group, real_vocab=VOCAB)


unreduced_token_loss_fn = {BROKEN: _unreduced_token_loss, FIXED: _padding_ignored}


def _reference(inputs):
    return cross_entropy(inputs["logits"][..., :VOCAB], inputs["target"])


def _run(impl, ctx, inputs):
    return impl.unreduced_token_loss_fn[variant(ctx)](inputs["logits"], inputs["target"], ctx.group("tp"))


def cases(quick: bool = False) -> list:
    op = f"{FAMILY}.unreduced_token_loss_fn"
    return twins(
        BUG, lambda v, where: ce_case(op, v, where, PADDED, _reference, _run, ignored=True, target_vocab=VOCAB)
    )
