"""pytorch/torchtitan#596: gradient clipping under pipeline parallelism by each stage's local norm.

`torch.nn.utils.clip_grad_norm_` over a stage's own parameters computes that stage's norm only; every pipeline stage
then clips with a different coefficient, none of them the global norm's (a release-blocking bug of torchtitan's PP).
Port: two stages' gradients, one per rank of a 2-rank group (laid on the tp mesh dim: the harness has no pp axis;
the arithmetic is the same), each clipped to the global norm 1.  Broken: `clip_grad_norm_` on the stage's own
gradients; fixed: the squared norms all-reduced over the stages first (torchtitan's clip_grad_norm_ with pp_mesh).
Named right: the op's one output (`forward`, the clipped gradients) and no more: each stage's every element is
scaled by its own wrong coefficient, so both ranks fail everywhere and the worst element is only the largest
gradient."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _twins import twins, variant

from shardcheck import Case, Layout, Shard
from shardcheck.harness.core.zoo_bug import BROKEN, FIXED, Bug

FAMILY = "torchtitan_596"
IMPLEMENTATION = __file__

BUG = Bug(
    thread="pytorch/torchtitan#596",
    url="https://github.com/pytorch/torchtitan/issues/596",
    title="clip_grad_norm_ under pipeline parallelism uses each stage's local gradient norm",
    symptom="each PP stage clips with its own norm: the update direction differs from the unsharded model's",
    time_to_find="labelled bug and release_blocking; the pp_mesh reduction was proposed 2024-10-03",
    fix="torchtitan's clip_grad_norm_ with pp_mesh: the stages' norms all-reduced",
    topology="dp=1,cp=1,tp=2",
    names=("forward",),
)

MAX_NORM = 1.0


def _local_norm(grads, group):
    norm = grads.norm()
    return grads * (MAX_NORM / (norm + 1e-6)).clamp(max=1.0)


def _global_norm(grads, group):
    total = grads.pow(2).sum()
    dist.all_reduce(total, group=group)
    return grads * (MAX_NORM / (total.sqrt() + 1e-6)).clamp(max=1.0)


clip_grad_norm_ = {BROKEN: _local_norm, FIXED: _global_norm}


def _make_inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
    stages = torch.randn(2, 12, generator=gen, dtype=torch.float64)
    stages[1] *= 3  # the stages' gradients of different sizes, as a model's first and last stages have
    return {"stage_grads": stages}


def _reference(inputs):
    g = inputs["stage_grads"]
    return g * (MAX_NORM / (g.norm() + 1e-6)).clamp(max=1.0)


def _case(v: str, where: dict) -> Case:
    return Case(
        op=f"{FAMILY}.clip_grad_norm_",
        case_id=v,
        make_inputs=_make_inputs,
        reference=_reference,
        run=lambda impl, ctx, inputs: impl.clip_grad_norm_[variant(ctx)](inputs["stage_grads"], ctx.group("tp")),
        input_layouts={"stage_grads": Layout(tp=Shard(0))},
        output_names=("clipped",),
        output_layouts=(Layout(tp=Shard(0)),),
        **where,
    )


def cases(quick: bool = False) -> list:
    return twins(BUG, _case)
