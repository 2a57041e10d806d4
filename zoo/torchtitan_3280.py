"""torchtitan#3280 (and #3329): with TP and CP together the logged loss is about half the real one.

torchtitan's `_dist_reduce(x, reduce_op, mesh)` returns `x.full_tensor().item()` when the loss is a DTensor, which
it is under TP (loss_parallel), without reducing over the data-parallel x context-parallel mesh it was given: at
TP 2 x CP 2 the logged loss is one CP rank's share of it, about half of the TP 4 or CP 4 one.  Port: each rank's
loss is its summand of the global mean (its tokens' loss sum over the global token count), a DTensor replicated
over tp; the logged loss is reduced over dp x cp.  Broken: the DTensor branch as torchtitan had it; fixed: its full
tensor reduced over the mesh as well (torchtitan PR #3159).  Named right: the op's one output (`forward`) and no
more: the logged loss is one number on every rank, each rank's its own CP share, so no element or rank is to blame
more than another (all four fail) and the error is no fixed factor (the shares differ)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _twins import twins, variant
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardcheck import Case, Layout
from shardcheck.harness.core.zoo_bug import BROKEN, FIXED, Bug

FAMILY = "torchtitan_3280"
IMPLEMENTATION = __file__

BUG = Bug(
    thread="pytorch/torchtitan#3280",
    url="https://github.com/pytorch/torchtitan/issues/3280",
    title="_dist_reduce skips the data/context-parallel reduction when the loss is a DTensor (TP on)",
    symptom="Qwen3-MoE on 4 GPUs: TP 2 + CP 2 logs a loss about half of the TP 4 or CP 4 one",
    time_to_find="reported 2026-05-08, root cause found 2026-05-10 (PR #3313), fixed 2026-07-10 (PR #3159): 2 months",
    fix="pytorch/torchtitan PR #3159",
    topology="dp=1,cp=2,tp=2",
    names=("forward",),
    related=("pytorch/torchtitan#3329", "pytorch/torchtitan#3313"),
)

BATCH, SEQ = 2, 8


def _as_torchtitan_had_it(x, mesh):
    if isinstance(x, DTensor):
        return x.full_tensor()  # the caller's mesh (dp x cp) dropped
    x = x.clone()
    dist.all_reduce(x, group=mesh.get_group())
    return x


def _reduced_over_the_mesh(x, mesh):
    x = x.full_tensor() if isinstance(x, DTensor) else x.clone()
    dist.all_reduce(x, group=mesh.get_group())
    return x


_dist_reduce = {BROKEN: _as_torchtitan_had_it, FIXED: _reduced_over_the_mesh}


def _make_inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {"token_loss": torch.rand(BATCH, SEQ, generator=gen, dtype=torch.float64) * 4}


def _run(impl, ctx, inputs):
    tokens = BATCH * SEQ
    summand = inputs["token_loss"].sum() / tokens  # this rank's share of the global mean, as the step computes it
    loss = DTensor.from_local(summand, ctx.mesh["tp"], [Replicate()])  # what loss_parallel's loss is under TP
    return impl._dist_reduce[variant(ctx)](loss, ctx.mesh["dp", "cp"]._flatten("dp_cp"))


def _case(v: str, where: dict) -> Case:
    return Case(
        op=f"{FAMILY}._dist_reduce",
        case_id=v,
        make_inputs=_make_inputs,
        reference=lambda inputs: inputs["token_loss"].mean(),
        run=_run,
        input_layouts={"token_loss": Layout(dp=Shard(0), cp=Shard(1))},
        output_names=("logged_loss",),
        **where,
    )


def cases(quick: bool = False) -> list:
    return twins(BUG, _case)
