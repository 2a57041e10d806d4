"""NeMo#12210 / TransformerEngine#1539: context parallelism with several micro-batches.

With CP and gradient accumulation over micro-batches the per-micro-batch CP state (the attention's saved chunks, the
token counts) must be each micro-batch's own; the threads report the loss and gradients leaving the CP 1 run only
when more than one micro-batch is accumulated.  NEEDS micro-batches in the model step (issue 38, r-steps); the pair
is the decoder at CP 2 over two micro-batches, broken as the threads had it, fixed as merged."""

from __future__ import annotations

from _pending import pending

from shardcheck.harness.core.zoo_bug import Bug, Capability

FAMILY = "nemo_12210"
IMPLEMENTATION = __file__

BUG = Bug(
    thread="NVIDIA/NeMo#12210",
    url="https://github.com/NVIDIA/NeMo/issues/12210",
    title="context parallelism with several micro-batches",
    symptom="loss and gradients differ from the CP 1 run only when several micro-batches are accumulated "
    "(thread not in the search index used here; from issue 43's list)",
    time_to_find="not read here (the thread is not in the search index)",
    fix="see TransformerEngine#1539",
    topology="dp=1,cp=2,tp=1",
    names=("the loss", "dparam"),
    related=("NVIDIA/TransformerEngine#1539",),
    needs=Capability.MICRO_BATCHES,
)


def cases(quick: bool = False) -> list:
    return pending(BUG)
