"""NVIDIA-NeMo/Automodel#1260: the experts' all-gather of the tokens had a backward that only slices.

`GroupedExperts.forward` gathered the tokens over the expert-parallel ranks with
`DTensor.from_local(x, mesh, [Shard(0)]).full_tensor()`; full_tensor's backward, with the default grad_placements,
takes the gradient for Replicate (the same on every rank) and returns this rank's slice without communication.  But
each rank applies different experts to the gathered tokens, so each token's gradient is the sum over the ranks:
the missing reduce-scatter left a ~14 % convergence gap (loss 1.6 against 1.4 at step 106, Qwen3-MoE 30B).  Port,
on the tp mesh dim (written before the ep axis; the gather and its backward are the same): tokens split over
the ranks, one expert per rank, the routing weights given.  Broken: `full_tensor()`; fixed:
`full_tensor(grad_placements=[Partial()])` (the backward reduce-scatters, as the fix's gather does)."""

from __future__ import annotations

import torch
from _twins import twins, variant
from torch.distributed.tensor import DTensor, Partial, Shard

from shardcheck import Case, Layout
from shardcheck.harness.core.zoo_bug import BROKEN, FIXED, Bug

FAMILY = "automodel_1260"
IMPLEMENTATION = __file__

BUG = Bug(
    thread="NVIDIA-NeMo/Automodel#1260",
    url="https://github.com/NVIDIA-NeMo/Automodel/pull/1260",
    title="tokens all-gathered with full_tensor() for per-rank experts: the backward slices instead of summing",
    symptom="GroupedExperts converged worse than GroupedExpertsDeepEP: loss ~1.6 against ~1.4 at step 106 "
    "(Qwen3-MoE 30B, a 14 % gap)",
    time_to_find="found comparing two dispatchers' loss curves; fixed by PR #1260 (2026-02-12, merged)",
    fix="NVIDIA-NeMo/Automodel PR #1260 (a gather whose backward reduce-scatters)",
    topology="dp=1,cp=1,tp=2",
    names=("grad:tokens",),
)

TOKENS, DIM = 6, 4


def _gathered(tokens, mesh, grad_placements):
    return DTensor.from_local(tokens, mesh, [Shard(0)]).full_tensor(grad_placements=grad_placements)


def _experts(tokens, experts, gates, ctx, grad_placements):
    mesh, rank = ctx.mesh["tp"], ctx.rank("tp")
    full = _gathered(tokens, mesh, grad_placements)
    mine = gates[:, rank : rank + 1] * (full @ experts[0])  # this rank's expert on every token: a partial sum
    return DTensor.from_local(mine, mesh, [Partial()]).redistribute(mesh, [Shard(0)]).to_local()


grouped_experts = {
    BROKEN: lambda t, e, g, ctx: _experts(t, e, g, ctx, None),
    FIXED: lambda t, e, g, ctx: _experts(t, e, g, ctx, [Partial()]),
}


def _make_inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "tokens": torch.randn(TOKENS, DIM, generator=gen, dtype=torch.float64),
        "experts": torch.randn(2, DIM, DIM, generator=gen, dtype=torch.float64) / DIM**0.5,
        "gates": torch.rand(TOKENS, 2, generator=gen, dtype=torch.float64),
    }


def _reference(inputs):
    x, w, g = inputs["tokens"], inputs["experts"], inputs["gates"]
    return sum(g[:, e : e + 1] * (x @ w[e]) for e in range(w.shape[0]))


def _run(impl, ctx, inputs):
    return impl.grouped_experts[variant(ctx)](inputs["tokens"], inputs["experts"], inputs["gates"], ctx)


def _case(v: str, where: dict) -> Case:
    return Case(
        op=f"{FAMILY}.grouped_experts",
        case_id=v,
        make_inputs=_make_inputs,
        reference=_reference,
        run=_run,
        input_layouts={"tokens": Layout(tp=Shard(0)), "experts": Layout(tp=Shard(0))},
        output_layouts=(Layout(tp=Shard(0)),),
        grad_inputs=("tokens", "experts"),
        **where,  # two experts: one per rank, at TP 2 only
    )


def cases(quick: bool = False) -> list:
    return twins(BUG, _case)
