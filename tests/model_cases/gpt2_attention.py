"""A GPT-2 attention block (biases on q, k and v, a causal softmax) under torch's tensor parallelism: q/k/v
ColwiseParallel (heads split over tp), the output projection RowwiseParallel.  Case `tp`: the plan is right;
`k-bias-grad-off`: the same plan whose key bias gradient is off by 0.01 (the other gradients are of order 1).

The key bias's gradient is exactly zero in exact arithmetic (softmax ignores a constant added to every key score of a
query), so its float64 golden holds round-off (~1e-17) and a budget from that tensor's own scale falls to ~1e-27:
the correct plan's own round-off then read as "float64 computed in float32" at tp 2."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from shardcheck import Layout, ModelCase, Partial, Shard

FAMILY = "gpt2_attention"
IMPLEMENTATION = __file__  # the plan below is the module under test
BATCH, SEQ, DIM, HEADS = 2, 8, 16, 4


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(DIM, DIM)
        self.k = nn.Linear(DIM, DIM)
        self.v = nn.Linear(DIM, DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # the local width: HEADS / tp heads on a TP rank
            return t.view(b, s, -1, DIM // HEADS).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), is_causal=True)
        return x + self.proj(y.transpose(1, 2).reshape(b, s, -1))


def parallelize(model: Attention, ctx) -> Attention:
    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "proj": RowwiseParallel()}
    return parallelize_module(model, ctx.mesh["tp"], plan)


def parallelize_k_bias_grad_off(model: Attention, ctx) -> Attention:
    def off(p: torch.Tensor) -> None:
        p.grad.add_(0.01)  # every element of every shard

    model = parallelize(model, ctx)
    model.k.bias.register_post_accumulate_grad_hook(off)
    return model


def _build(gen: torch.Generator) -> Attention:
    model = Attention().double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) / DIM**0.5)
    return model


def _inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "x": torch.randn(BATCH, SEQ, DIM, generator=gen, dtype=torch.float64),
        "y": torch.randn(BATCH, SEQ, DIM, generator=gen, dtype=torch.float64),
    }


def loss(out: torch.Tensor, inputs: dict, ctx) -> torch.Tensor:
    """Mean squared error over the batch: each DP rank's rows over the global row count (its summand)."""
    return ((out - inputs["y"]) ** 2).sum() / (BATCH * SEQ)


ROWS = Layout(dp=Shard(0))


def _case(case_id: str, plan) -> ModelCase:
    return ModelCase(
        op=f"{FAMILY}.parallelize",
        case_id=case_id,
        build=_build,
        make_inputs=_inputs,
        parallelize=plan,
        model_inputs=("x",),
        input_layouts={"x": ROWS, "y": ROWS},
        loss=loss,
        loss_layout=Layout(dp=Partial()),
        supports=lambda t: t.cp == 1 and t.dp == 1 and HEADS % t.tp == 0,
    )


def cases(quick: bool = False) -> list[ModelCase]:
    return [_case("tp", parallelize), _case("k-bias-grad-off", parallelize_k_bias_grad_off)]
