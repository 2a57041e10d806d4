"""NVIDIA-NeMo/RL#3788: the gradient norm counts TP-replicated gradients once per TP rank.

NeMo RL's `get_grad_norm` sums every local gradient's |g|² and all-reduces the sum over the TP group; that is right
for gradients sharded over TP and counts a replicated one (norm weights, biases, router weights) tp_size times, so
the logged grad_norm is over-reported and `clip_grad_by_total_norm_` clips harder than max_grad_norm asks.  Port at
TP 2: a weight's gradient split over TP and a norm weight's replicated one; the op returns the total norm and the
sharded gradient clipped to norm 1.  Broken: NeMo RL's sum; fixed: a replicated gradient counted once (Megatron's
clip_grads.py rule)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _twins import twins, variant

from shardcheck import REPLICATED, Case, Layout, Shard
from shardcheck.harness.core.zoo_bug import BROKEN, FIXED, Bug

FAMILY = "nemo_rl_3788"
IMPLEMENTATION = __file__

BUG = Bug(
    thread="NVIDIA-NeMo/RL#3788",
    url="https://github.com/NVIDIA-NeMo/RL/pull/3788",
    title="get_grad_norm sums TP-replicated gradients' squares over the TP group",
    symptom="grad_norm systematically over-reported, growing with tp_size; clipping fires more often than "
    "policy.max_grad_norm asks",
    time_to_find="found reading the code against Megatron's clip_grads.py (2026-08-24); the PR is open",
    fix="open: NVIDIA-NeMo/RL PR #3788 (count TP-replicated gradients once)",
    topology="dp=1,cp=1,tp=2",
    names=("forward:grad_norm",),
)

MAX_NORM = 1.0


def _sum_over_tp(sharded, replicated, group, tp_rank):
    total = sharded.pow(2).sum() + replicated.pow(2).sum()
    dist.all_reduce(total, group=group)
    return total.sqrt()


def _replicated_once(sharded, replicated, group, tp_rank):
    total = sharded.pow(2).sum() + (replicated.pow(2).sum() if tp_rank == 0 else 0)
    dist.all_reduce(total, group=group)
    return total.sqrt()


get_grad_norm = {BROKEN: _sum_over_tp, FIXED: _replicated_once}


def _make_inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "sharded_grad": torch.randn(8, 4, generator=gen, dtype=torch.float64),
        "replicated_grad": 2 * torch.randn(4, generator=gen, dtype=torch.float64),
    }


def _clip(grad, norm):
    return grad * (MAX_NORM / (norm + 1e-6)).clamp(max=1.0)


def _reference(inputs):
    norm = torch.cat([inputs["sharded_grad"].flatten(), inputs["replicated_grad"]]).norm()
    return norm, _clip(inputs["sharded_grad"], norm)


def _run(impl, ctx, inputs):
    grad_norm = impl.get_grad_norm[variant(ctx)]
    norm = grad_norm(inputs["sharded_grad"], inputs["replicated_grad"], ctx.group("tp"), ctx.rank("tp"))
    return norm, _clip(inputs["sharded_grad"], norm)


def _case(v: str, where: dict) -> Case:
    return Case(
        op=f"{FAMILY}.get_grad_norm",
        case_id=v,
        make_inputs=_make_inputs,
        reference=_reference,
        run=_run,
        input_layouts={"sharded_grad": Layout(tp=Shard(0))},
        output_names=("grad_norm", "clipped"),
        output_layouts=(REPLICATED, Layout(tp=Shard(0))),
        **where,
    )


def cases(quick: bool = False) -> list:
    return twins(BUG, _case)
