"""BROKEN: FSDP2's gradient divide factor set to 1 on every unit (`set_gradient_divide_factor(1.0)`, the sum
convention's setting) where each DP rank's loss is its own mean: every parameter's gradient is summed over dp, dp
times the average (the finding says so: every wrong tensor ×dp)."""

from __future__ import annotations

from _dp_avg_plan import fsdp2, loss  # noqa: F401


def parallelize(model, ctx):
    if ctx.size("dp") == 1:
        return model
    model = fsdp2(model, ctx)
    for unit in [*model.blocks, model]:
        unit.set_gradient_divide_factor(1.0)
    return model
