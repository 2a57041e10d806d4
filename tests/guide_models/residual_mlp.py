"""A model suite written from docs/model-cases.md alone, for a model that is not among the examples: a stack of
pre-norm residual MLP blocks (LayerNorm, GELU) with a regression head, under torch's tensor parallelism
(`parallelize_module`: each block's `up` ColwiseParallel, `down` RowwiseParallel) and data parallelism over `dp`
(the batch split, every parameter's gradient all-reduced over DP by a post-accumulate-grad hook, as DDP does).

Cases: `tp-dp` (right), `no-dp-sync` (the DP all-reduce forgotten: each DP rank steps with its own rows' gradient;
the forward and the activations' gradients agree, the first divergence is a parameter's gradient)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from shardcheck import Layout, ModelCase, Partial, Shard

FAMILY = "residual_mlp"
IMPLEMENTATION = __file__  # the plan below is the module under test
BATCH, DIM, HIDDEN, BLOCKS = 8, 8, 16, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.act = nn.GELU()
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def parallelize(model: Net, ctx, dp_sync: bool = True) -> Net:
    """TP inside each block over ctx.mesh["tp"]; DP: every gradient summed over the DP group after backward."""
    for block in model.blocks:
        parallelize_module(block, ctx.mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if dp_sync and ctx.size("dp") > 1:
        group = ctx.group("dp")

        def all_reduce(p: torch.Tensor) -> None:
            dist.all_reduce(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad, group=group)

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(all_reduce)
    return model


def parallelize_no_dp_sync(model: Net, ctx) -> Net:
    return parallelize(model, ctx, dp_sync=False)


def _build(gen: torch.Generator) -> Net:
    model = Net().double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            p.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else noise / p.shape[-1] ** 0.5)
    return model


def _inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(BATCH, DIM, generator=gen, dtype=torch.float64),
            "y": torch.randn(BATCH, 1, generator=gen, dtype=torch.float64)}


def loss(out: torch.Tensor, inputs: dict, ctx) -> torch.Tensor:
    """Mean squared error over the whole batch: each DP rank's rows divided by the global row count (its summand)."""
    return ((out - inputs["y"]) ** 2).sum() / BATCH


ROWS = Layout(dp=Shard(0))  # x, y: the batch over DP, whole on every TP rank


def _case(case_id: str, plan) -> ModelCase:
    return ModelCase(op=f"{FAMILY}.parallelize", case_id=case_id, build=_build, make_inputs=_inputs,
                     parallelize=plan, model_inputs=("x",), input_layouts={"x": ROWS, "y": ROWS},
                     loss=loss, loss_layout=Layout(dp=Partial()),
                     supports=lambda t: t.cp == 1 and HIDDEN % t.tp == 0 and BATCH % t.dp == 0)


def cases(quick: bool = False) -> list[ModelCase]:
    return [_case("tp-dp", parallelize), _case("no-dp-sync", parallelize_no_dp_sync)]
