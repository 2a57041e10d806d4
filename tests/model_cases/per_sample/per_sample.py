"""shardcheck suite of a model case that declares batch invariance (docs/model-cases.md, "Batch invariance"): a token
classifier (`_sample_model.py`) under TP and FSDP2 (`_sample_plan.py`, the module under test), each sample's module
outputs required to stay bit for bit the same with the batch permuted and split.

    shardcheck run --suite-path tests/model_cases/per_sample --topology dp=2,cp=1,tp=2

Broken plans (each one finding, `property:batch_invariant:*` naming the module and the sample):
tests/broken/per_sample/."""

from __future__ import annotations

import torch
from _sample_model import BATCH, HIDDEN, build, make_inputs
from torch.distributed.tensor import Partial, Shard

from shardcheck import BatchInvariance, Layout, ModelCase

FAMILY = "per_sample"
IMPLEMENTATION = "_sample_plan.py"
ROWS = Layout(dp=Shard(0))  # features and labels: the batch split over DP, whole on every TP rank


def _loss(logits: torch.Tensor, inputs: dict, ctx) -> torch.Tensor:
    import _sample_plan  # the reference's loss is the correct plan's

    return (ctx.impl if ctx is not None else _sample_plan).loss(logits, inputs, ctx)


def _supports(t) -> bool:
    return t.cp == 1 and HIDDEN % t.tp == 0 and BATCH % (2 * t.dp) == 0


def cases(quick: bool = False) -> list[ModelCase]:
    return [
        ModelCase(
            op=f"{FAMILY}.parallelize",
            case_id="batch-invariant",
            build=build,
            parallelize=lambda model, ctx: ctx.impl.parallelize(model, ctx),
            make_inputs=make_inputs,
            model_inputs=("x",),
            input_layouts={"x": ROWS, "labels": ROWS},
            loss=_loss,
            loss_layout=Layout(dp=Partial()),
            supports=_supports,
            batch_invariance=BatchInvariance(),
        )
    ]
