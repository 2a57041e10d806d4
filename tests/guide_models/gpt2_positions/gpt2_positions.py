"""shardcheck suite of a GPT-2-like model with learned positions (`_gpt2.py`) under TP and DP (`_gpt2_plan.py`, the
module under test): `wpe(arange(S))` is [S, D], without a batch dim, the same on every DP rank, while the gradient
arriving at it on each DP rank is its own rows' share of the whole one.  The harness judges that value as
replicated over dp and its gradient as summed over dp, with nothing declared.

    shardcheck run --suite-path tests/guide_models/gpt2_positions --world-sizes 1,2,4

Broken plans (each one finding): tests/broken/gpt2_positions/."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _gpt2 import DIM, HEADS, HIDDEN, SEQ, VOCAB, build
from torch.distributed.tensor import Partial, Shard

from shardcheck import REPLICATED, Layout, ModelCase

FAMILY = "gpt2_positions"
IMPLEMENTATION = "_gpt2_plan.py"
BATCH = 4
ROWS = Layout(dp=Shard(0))  # ids and targets: the batch split over DP, whole on every TP rank


def _inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return {"ids": tokens[:, :-1].contiguous(), "targets": tokens[:, 1:].contiguous()}


def loss(logits: torch.Tensor, inputs: dict, ctx) -> torch.Tensor:
    """Next-token cross-entropy over the whole batch: each DP rank's tokens summed over the global token count."""
    nll = F.cross_entropy(logits.flatten(0, 1), inputs["targets"].flatten(), reduction="sum")
    return nll / (BATCH * SEQ)


def _supports(t) -> bool:
    return t.cp == 1 and BATCH % t.dp == 0 and all(n % t.tp == 0 for n in (VOCAB, HEADS, DIM, HIDDEN))


def _case(case_id: str, activation_layouts: dict[str, Layout]) -> ModelCase:
    return ModelCase(
        op=f"{FAMILY}.parallelize",
        case_id=case_id,
        build=build,
        parallelize=lambda model, ctx: ctx.impl.parallelize(model, ctx),
        make_inputs=_inputs,
        model_inputs=("ids",),
        input_layouts={"ids": ROWS, "targets": ROWS},
        loss=loss,
        loss_layout=Layout(dp=Partial()),
        activation_layouts=activation_layouts,
        supports=_supports,
    )


def cases(quick: bool = False) -> list[ModelCase]:
    # `wpe-declared`: its output declared replicated, as a user would write it; its gradient is then summed over dp
    # all the same (a declaration says the value's layout, not its gradient's).
    return [_case("tp-dp", {}), _case("wpe-declared", {"wpe": REPLICATED})]
