"""BROKEN: AdamW's step counter advanced twice on one rank (TP rank 1), as where each rank restores its own optimizer
state and one of them was saved a step later: that rank's bias correction is another step's, so its parameters move
by other amounts than the other ranks' from the first step on."""

from __future__ import annotations

import torch
from _step_plan import clip_grad, loss, parallelize  # noqa: F401 (the plan's other functions, unchanged)
from torch import nn


def optimizer(params: list[nn.Parameter], lr: float, ctx) -> torch.optim.Optimizer:
    adamw = torch.optim.AdamW(params, lr=lr, weight_decay=0.1)
    if ctx.rank("tp") == 1:

        def count_again(opt, args, kwargs):
            for state in opt.state.values():
                if "step" in state:
                    state["step"] += 1

        adamw.register_step_pre_hook(lambda opt, args, kwargs: count_again(opt, args, kwargs) if opt.state else None)
    return adamw
