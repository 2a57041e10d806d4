"""Megatron-LM#7452, finding 2: GPTModel's labels path hands the TP-gathered logits to the vocab-parallel loss.

With TP > 1, labels passed and `parallel_output=False` (or `runtime_gather_output=True`), GPTModel gathers the
logits over TP and then calls `vocab_parallel_cross_entropy`, which takes its input for this rank's vocabulary
slice: the sum of exponentials is all-reduced over TP ranks that each hold the whole vocabulary, and the loss comes
out as the right one plus log(TP), with wrong gradients.  Port: the full logits on every rank at TP 2.  Broken: the
gathered logits into the vocab-parallel loss; fixed: this rank's slice of them (what the loss expects).  Named
right: the loss (`forward`, its one output) off by log(TP) = 0.693, the error the fix removes (`shows`); every
token of every rank is off by as much, so no element or rank is more to blame than another."""

from __future__ import annotations

import torch
from _twins import twins, variant
from _vocab_ce import cross_entropy, vocab_parallel_cross_entropy

from shardcheck import Case
from shardcheck.harness.core.zoo_bug import BROKEN, FIXED, Bug

FAMILY = "megatron_lm_7452_gathered_logits"
IMPLEMENTATION = __file__

BUG = Bug(
    thread="NVIDIA/Megatron-LM#7452 (finding 2)",
    url="https://github.com/NVIDIA/Megatron-LM/issues/7452",
    title="GPTModel's labels path passes TP-gathered logits to vocab_parallel_cross_entropy",
    symptom="loss = correct + log(TP); wrong gradients (found by a fuzz of Megatron-Core with spmd_types)",
    time_to_find="found by a tool (Astra + spmd_types) on 2026-09-17; no user report before it",
    fix="open (reported in #7452, no related upstream thread)",
    topology="dp=1,cp=1,tp=2",
    names=("forward",),
    shows={"forward": r"\|err\| 0\.693 "},  # every token's loss off by log(TP) = log 2
)

BATCH, SEQ, VOCAB = 2, 3, 16


def _gathered(logits, target, group):
    return vocab_parallel_cross_entropy(logits, target, group)


def _local_slice(logits, target, group):
    tp, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    return vocab_parallel_cross_entropy(logits.chunk(tp, -1)[rank], target, group)


compute_language_model_loss = {BROKEN: _gathered, FIXED: _local_slice}


def _make_inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
    logits = 2 * torch.randn(BATCH, SEQ, VOCAB, generator=gen, dtype=torch.float64)
    return {"logits": logits, "target": torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)}


def _run(impl, ctx, inputs):
    # the gathered logits are the same whole tensor on every rank: each rank's gradient is its own use's
    # (summed over TP they are the gradient of the loss: `summed_over`)
    return impl.compute_language_model_loss[variant(ctx)](inputs["logits"], inputs["target"], ctx.group("tp"))


def _case(v: str, where: dict) -> Case:
    return Case(
        op=f"{FAMILY}.compute_language_model_loss",
        case_id=v,
        make_inputs=_make_inputs,
        reference=lambda inputs: cross_entropy(inputs["logits"], inputs["target"]),
        run=_run,
        output_names=("loss",),
        **where,
    )


def cases(quick: bool = False) -> list:
    return twins(BUG, _case)
