"""shardcheck suite of data parallelism in the averaged convention (DDP's, FSDP2's default, Megatron's): each DP
rank's loss is the mean over its own rows and the gradients are averaged over dp, declared once as
`loss_layout=Layout(dp=Partial("avg"))`.  The model (`_dp_avg_model.py`) has learned positions, a value without a
batch dim; the plan (`_dp_avg_plan.py`, the module under test) wraps it in FSDP2, DDP or FSDP1 (case = wrapper;
`fsdp2-cp`: the sequence split over cp too, FSDP2 over dp x cp averaging over both,
`loss_layout=Layout(dp=Partial("avg"), cp=Partial("avg"))`; `hsdp`: FSDP2 on the data mesh replicate x shard,
`--topology dp=4,dp_replicate=2`).

    shardcheck run --suite-path tests/model_cases/dp_avg --world-sizes 1,2,4

Broken plans (each one finding): tests/broken/dp_avg/."""

from __future__ import annotations

from _dp_avg_model import BATCH, SEQ, build, inputs, mean_loss
from torch.distributed.tensor import Partial, Shard

from shardcheck import Layout, ModelCase

FAMILY = "dp_avg"
IMPLEMENTATION = "_dp_avg_plan.py"
TOKENS = Layout(dp=Shard(0), cp=Shard(1))  # x, y: the batch over dp, the sequence over cp


def loss(out, data: dict, ctx):
    """The plan's loss on a rank (the module under test's), the whole batch's mean on one device."""
    return mean_loss(out, data) if ctx is None else ctx.impl.loss(out, data, ctx)


def _case(wrapper: str) -> ModelCase:
    over_cp, hsdp = wrapper == "fsdp2-cp", wrapper == "hsdp"
    return ModelCase(
        op=f"{FAMILY}.parallelize",
        case_id=wrapper,
        build=build,
        parallelize=lambda model, ctx: ctx.impl.parallelize(model, ctx),
        make_inputs=inputs,
        model_inputs=("x", "pos"),
        input_layouts={"x": TOKENS, "y": TOKENS, "pos": Layout(cp=Shard(0))},
        # the positions' value [S, D]: the sequence split over cp (its local shape alone would read as the batch's)
        activation_layouts={"wpe": Layout(cp=Shard(0))},
        loss=loss,
        loss_layout=Layout(dp=Partial("avg"), cp=Partial("avg")),
        supports=lambda t: (
            t.tp == 1
            and BATCH % t.dp == 0
            and SEQ % t.cp == 0
            and (over_cp or t.cp == 1)
            and (t.dp_replicate > 1) == hsdp
        ),
        hsdp=hsdp,  # runs where asked: --topology dp=4,dp_replicate=2
        params={"wrapper": wrapper},
    )


def cases(quick: bool = False) -> list[ModelCase]:
    return [_case(wrapper) for wrapper in ("fsdp2", "ddp", "fsdp1", "fsdp2-cp", "hsdp", "compiled")]
