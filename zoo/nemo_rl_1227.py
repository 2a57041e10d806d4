"""NVIDIA-NeMo/RL#1227: with TP > 1 and bf16, identical rows' logits and log-probs differ with their position in
the micro-batch.

The DTensor policy worker's TP forward gave a row a result that depended on where it sat in the micro-batch and on
the rows around it (a reduction whose order follows the batch's composition), so the same sequence scored twice
did not agree; fp32 hid it.  Port: vocab-parallel log-probabilities of targets at TP 2, declared batch-invariant
(shardcheck.batch_invariance: the rows permuted and split must give the same rows bit for bit).  Broken: the sum of
exponentials taken with one running accumulator over the whole micro-batch (each row's sum the difference of two
running totals, as a kernel that streams the flattened batch does); fixed: each row reduced on its own.  The values
of the broken op are within every float64 budget: only the batch-invariance check sees it."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _twins import twins, variant

from shardcheck import Case, Layout, Shard, batch_invariance
from shardcheck.harness.core.zoo_bug import BROKEN, FIXED, Bug

FAMILY = "nemo_rl_1227"
IMPLEMENTATION = __file__

BUG = Bug(
    thread="NVIDIA-NeMo/RL#1227",
    url="https://github.com/NVIDIA-NeMo/RL/issues/1227",
    title="TP bf16 log-probs of a row depend on its position in the micro-batch",
    symptom="identical rows yield different outputs depending on their position in the microbatch; consecutive "
    "forward passes differ; reward-model training affected; fp32 mitigates",
    time_to_find="reported 2025-09-29, still open; the TP accuracy guide (NeMo-RL PR #1767, 2026-01) documents "
    "the TP discrepancies",
    fix="open (batch-invariant kernels: NeMo-RL PR #3848, for reference)",
    topology="dp=1,cp=1,tp=2",
    names=("property:batch_invariant",),
    related=("NVIDIA-NeMo/RL#1767", "NVIDIA-NeMo/RL#3848"),
)

ROWS, VOCAB = 6, 16


def _logprobs(logits, target, group, sum_exp_of):
    top = logits.max(-1, keepdim=True).values
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - top
    sum_exp = sum_exp_of(shifted.exp())
    dist.all_reduce(sum_exp, group=group)
    rank, part = dist.get_rank(group), logits.shape[-1]
    mine = (target >= rank * part) & (target < (rank + 1) * part)
    picked = shifted.gather(-1, torch.where(mine, target - rank * part, 0).unsqueeze(-1)).squeeze(-1)
    picked = torch.where(mine, picked, 0)
    dist.all_reduce(picked, group=group)
    return picked - sum_exp.log()


def _streamed_over_the_batch(exp):
    running = exp.flatten().cumsum(0).view_as(exp)[:, -1]  # one accumulator over the flattened micro-batch
    return running - torch.cat([running.new_zeros(1), running[:-1]])


def _row_by_row(exp):
    return exp.sum(-1)


def _broken(logits, target, group):
    return _logprobs(logits, target, group, _streamed_over_the_batch)


def _fixed(logits, target, group):
    return _logprobs(logits, target, group, _row_by_row)


get_logprobs = {BROKEN: _broken, FIXED: _fixed}


def _make_inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
    logits = 3 * torch.randn(ROWS, VOCAB, generator=gen, dtype=torch.float64)
    logits[3] = logits[1]  # two identical rows at different positions, as in the report
    return {"logits": logits, "target": torch.randint(0, VOCAB, (ROWS,), generator=gen)}


def _reference(inputs):
    return torch.log_softmax(inputs["logits"], -1).gather(-1, inputs["target"].unsqueeze(-1)).squeeze(-1)


def _run(impl, ctx, inputs):
    return impl.get_logprobs[variant(ctx)](inputs["logits"], inputs["target"], ctx.group("tp"))


def _case(v: str, where: dict) -> Case:
    return Case(
        op=f"{FAMILY}.get_logprobs",
        case_id=v,
        make_inputs=_make_inputs,
        reference=_reference,
        run=_run,
        input_layouts={"logits": Layout(tp=Shard(-1))},
        output_names=("logprobs",),
        properties=batch_invariance(_run, ("logits", "target")),
        **where,
    )


def cases(quick: bool = False) -> list:
    return twins(BUG, _case)
