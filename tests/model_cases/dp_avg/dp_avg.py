"""shardcheck suite of data parallelism in the averaged convention (DDP's, FSDP2's default, Megatron's): each DP
rank's loss is the mean over its own rows and the gradients are averaged over dp, declared once as
`loss_layout=Layout(dp=Partial("avg"))`.  The model (`_dp_avg_model.py`) has learned positions, a value without a
batch dim; the plan (`_dp_avg_plan.py`, the module under test) wraps it in FSDP2, DDP or FSDP1 (case = wrapper).

    shardcheck run --suite-path tests/model_cases/dp_avg --world-sizes 1,2,4

Broken plans (each one finding): tests/broken/dp_avg/."""

from __future__ import annotations

from _dp_avg_model import BATCH, build, inputs, mean_loss
from torch.distributed.tensor import Partial, Shard

from shardcheck import Layout, ModelCase

FAMILY = "dp_avg"
IMPLEMENTATION = "_dp_avg_plan.py"
ROWS = Layout(dp=Shard(0))


def loss(out, data: dict, ctx):
    """The plan's loss on a rank (the module under test's), the whole batch's mean on one device."""
    return mean_loss(out, data) if ctx is None else ctx.impl.loss(out, data, ctx)


def _case(wrapper: str) -> ModelCase:
    return ModelCase(
        op=f"{FAMILY}.parallelize",
        case_id=wrapper,
        build=build,
        parallelize=lambda model, ctx: ctx.impl.parallelize(model, ctx),
        make_inputs=inputs,
        model_inputs=("x",),
        input_layouts={"x": ROWS, "y": ROWS},
        loss=loss,
        loss_layout=Layout(dp=Partial("avg")),
        supports=lambda t: t.cp == 1 and t.tp == 1 and BATCH % t.dp == 0,
        params={"wrapper": wrapper},
    )


def cases(quick: bool = False) -> list[ModelCase]:
    return [_case(wrapper) for wrapper in ("fsdp2", "ddp", "fsdp1")]
