"""shardcheck suite of tp_mlp.parallelize: the parameter-gradient recipe of docs/writing-a-suite.md.

shardcheck run --suite-path docs/writing-a-suite/tp_mlp_suite.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from shardcheck import REPLICATED, Case, GradSum, Layout, Shard

FAMILY = "tp_mlp"
IMPLEMENTATION = "tp_mlp.py"
DIM, HIDDEN = 8, 12

# Each parameter is an input of the case, laid out as the plan shards it: ColwiseParallel splits `up`'s output
# features (weight rows, bias), RowwiseParallel `down`'s input features (weight columns) and keeps its bias whole.
PARAMS = {
    "up.weight": Layout(tp=Shard(0)),
    "up.bias": Layout(tp=Shard(0)),
    "down.weight": Layout(tp=Shard(1)),
    "down.bias": REPLICATED,
}
BATCH = Layout(dp=Shard(0))  # x and y [B, DIM]: the batch over DP, whole on every TP rank


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def make_inputs(batch: int):
    def make(gen: torch.Generator) -> dict[str, torch.Tensor]:
        shapes = {"up.weight": (HIDDEN, DIM), "up.bias": (HIDDEN,), "down.weight": (DIM, HIDDEN), "down.bias": (DIM,)}
        params = {n: torch.randn(s, generator=gen, dtype=torch.float64) / s[-1] ** 0.5 for n, s in shapes.items()}
        return {"x": torch.randn(batch, DIM, generator=gen, dtype=torch.float64), **params}

    return make


def reference(x: dict) -> torch.Tensor:
    """The MLP on one device, its parameters taken from the inputs (so their gradients are the golden ones)."""
    return torch.func.functional_call(MLP().to(x["x"]), {n: x[n] for n in PARAMS}, (x["x"],))


def run(impl, ctx, x: dict) -> torch.Tensor:
    """This rank's MLP under the plan, called on this rank's pieces of the parameters: the gradients land on them."""
    model = impl.parallelize(MLP().to(device=ctx.device, dtype=ctx.dtype), ctx.mesh["tp"])
    own = dict(model.named_parameters())  # DTensors: their mesh, placements, global shape and stride
    params = {}
    for name in PARAMS:
        local = x[name]
        if ctx.size("dp") > 1:  # each DP rank's gradient covers its batch rows only: summed over DP, as DDP does
            local = GradSum.apply(local, (ctx.group("dp"),))
        p = own[name]
        params[name] = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
    return torch.func.functional_call(model, params, (x["x"],))


def cases(quick: bool = False) -> list[Case]:
    return [
        Case(
            op="tp_mlp.parallelize",
            case_id=f"b{batch}",
            make_inputs=make_inputs(batch),
            reference=reference,
            run=run,
            input_layouts={"x": BATCH, **PARAMS},
            output_layouts=(BATCH,),
            grad_inputs=("x", *PARAMS),
            supports=lambda t, batch=batch: t.cp == 1 and HIDDEN % t.tp == 0 and batch >= t.dp,
        )
        for batch in ((4,) if quick else (4, 7))
    ]
