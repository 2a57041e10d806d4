"""A model suite as a user writes one from docs/writing-a-suite.md, for a model that is not among the examples: a
two-layer MLP regressor whose tensor-parallel plan is the user's own code holding plain local shards (Megatron's
column- then row-parallel linear, an all-reduce of the output written as an autograd function).  The parameters'
layouts are declared by glob, and so is `down`'s output (a partial sum); the other activations' layouts are read
from their local shapes.

Cases: `tp` (right), `no-layouts` (the layouts left out: one clear error naming the parameter), `no-allreduce`
(the row-parallel output never summed over TP: the first diverging module is `reduce`)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from shardcheck import Layout, ModelCase, Partial, Shard

FAMILY = "plain_tp_mlp"
IMPLEMENTATION = __file__


class MLP(nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 16):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.down = nn.Linear(hidden, dim, bias=False)
        self.reduce = nn.Identity()  # where the row-parallel partial sums meet

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.down(self.act(self.up(x))))


class AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        return g, None


class SumOver(nn.Module):
    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, x):
        return AllReduce.apply(x, self.group)


class Copy(torch.autograd.Function):
    """Identity forward, all-reduce backward: the input of a column-parallel layer (Megatron's copy_to_region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


def parallelize(model: MLP, ctx, reduce: bool = True) -> MLP:
    """Megatron-style: `up` keeps its rows (output features) of this TP rank, `down` its columns; plain tensors."""
    n = ctx.size("tp")
    group = ctx.group("tp")
    up, down = model.up, model.down
    rows = up.out_features // n
    local_up = nn.Linear(up.in_features, rows, dtype=up.weight.dtype)
    local_down = nn.Linear(rows, down.out_features, bias=False, dtype=down.weight.dtype)
    model.up, model.down = local_up, local_down  # weights: the harness puts the full model's pieces in
    if n > 1:
        model.up.register_forward_pre_hook(lambda m, args: (Copy.apply(args[0], group),))
        if reduce:
            model.reduce = SumOver(group)
    return model


def parallelize_no_allreduce(model: MLP, ctx) -> MLP:
    return parallelize(model, ctx, reduce=False)


def _inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "x": torch.randn(4, 8, generator=gen, dtype=torch.float64),
        "y": torch.randn(4, 8, generator=gen, dtype=torch.float64),
    }


def _build(gen: torch.Generator) -> MLP:
    model = MLP().double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) / 3)
    return model


LAYOUTS = {"up.weight": Layout(tp=Shard(0)), "up.bias": Layout(tp=Shard(0)), "down.weight": Layout(tp=Shard(1))}


def _case(case_id: str, plan, layouts) -> ModelCase:
    return ModelCase(
        op=f"{FAMILY}.parallelize",
        case_id=case_id,
        build=_build,
        make_inputs=_inputs,
        parallelize=plan,
        model_inputs=("x",),
        param_layouts=layouts,
        activation_layouts={"down": Layout(tp=Partial())},  # each TP rank's summand, before `reduce`
        loss=lambda out, inputs, ctx: ((out - inputs["y"]) ** 2).mean(),
        supports=lambda t: t.dp == 1 and t.cp == 1,
    )


def cases(quick: bool = False) -> list[ModelCase]:
    return [
        _case("tp", parallelize, LAYOUTS),
        _case("no-layouts", parallelize, {}),
        _case("no-allreduce", parallelize_no_allreduce, LAYOUTS),
    ]
