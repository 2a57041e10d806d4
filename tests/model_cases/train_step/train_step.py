"""shardcheck suite of the training step's features (docs/model-cases.md, "The training step"): a token classifier
(`_step_model.py`) under TP and FSDP2 (`_step_plan.py`, the module under test), its step run with micro-batches of
uneven token counts, clipping by the global norm, three AdamW steps (the plan's optimizer) and activation checkpointing.

    shardcheck run --suite-path tests/model_cases/train_step --topology dp=2,cp=1,tp=2

Cases: `plain` (one micro-batch, one SGD step: the step every model case ran before), `steps` (micro-batches,
clipping, three AdamW steps, checkpointing), `mixed-precision` (the same under FSDP2's MixedPrecisionPolicy),
`hsdp-steps` (the same as `steps` on HSDP's replicate x shard data mesh: `--topology dp=4,dp_replicate=2` only),
`hsdp-mixed-precision` (every feature at once on that mesh: `mixed-precision`'s policy too).
Broken plans (each one finding): tests/broken/train_step/."""

from __future__ import annotations

import torch
from _step_model import BATCH, CLASSES, HIDDEN, build, make_inputs
from _step_plan import MIXED_PRECISION
from torch.distributed.tensor import Partial, Shard

from shardcheck import Layout, ModelCase
from shardcheck.harness.core.train_step import clip_grad_norm

FAMILY = "train_step"
IMPLEMENTATION = "_step_plan.py"
ROWS = Layout(dp=Shard(0))  # features and labels: the batch split over DP, whole on every TP rank


def _loss(logits: torch.Tensor, inputs: dict, ctx) -> torch.Tensor:
    import _step_plan  # the reference's loss is the correct plan's

    return (ctx.impl if ctx is not None else _step_plan).loss(logits, inputs, ctx)


def _clip(params, max_norm: float, ctx) -> torch.Tensor:
    return clip_grad_norm(params, max_norm, None) if ctx is None else ctx.impl.clip_grad(params, max_norm, ctx)


def _optimizer(params, lr: float, ctx) -> torch.optim.Optimizer:
    import _step_plan

    return (ctx.impl if ctx is not None else _step_plan).optimizer(params, lr, ctx)


def _supports(t) -> bool:
    return t.cp == 1 and HIDDEN % t.tp == 0 and BATCH % (2 * t.dp) == 0 and CLASSES > 0


def _hsdp_only(t) -> bool:
    return _supports(t) and t.tp == 1 and t.dp_replicate > 1


def case(case_id: str, plan: str = "parallelize", **step) -> ModelCase:
    checkpointed = step.pop("checkpointed", False)
    return ModelCase(
        op=f"{FAMILY}.{plan}",
        case_id=case_id,
        build=lambda gen: build(gen, checkpointed),
        parallelize=lambda model, ctx: getattr(ctx.impl, plan)(model, ctx),
        make_inputs=make_inputs,
        model_inputs=("x",),
        input_layouts={"x": ROWS, "labels": ROWS},
        loss=_loss,
        loss_layout=Layout(dp=Partial()),
        **{"supports": _supports, **step},
    )


STEP = dict(microbatches=2, steps=3, optimizer=_optimizer, lr=0.01, clip_grad_norm=0.5, clip_grad=_clip)


def cases(quick: bool = False) -> list[ModelCase]:
    return [
        case("plain"),
        case("steps", checkpointed=True, **STEP),
        # and FSDP2's mixed precision (bf16 parameters, fp32 reduction) on float32 (and bfloat16) master weights
        case(
            "mixed-precision",
            "parallelize_mixed_precision",
            checkpointed=True,
            mixed_precision=MIXED_PRECISION,
            **STEP,
        ),
        # every feature at once on HSDP's 2-D data mesh (--topology dp=4,dp_replicate=2)
        case("hsdp-steps", "parallelize_hsdp", checkpointed=True, hsdp=True, supports=_hsdp_only, **STEP),
        case(
            "hsdp-mixed-precision",
            "parallelize_hsdp_mixed_precision",
            checkpointed=True,
            hsdp=True,
            supports=_hsdp_only,
            mixed_precision=MIXED_PRECISION,
            **STEP,
        ),
    ]
