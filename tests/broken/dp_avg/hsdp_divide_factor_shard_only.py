"""BROKEN (pytorch#155903's kind): HSDP's gradient divide factor set to the shard group's size alone
(`set_gradient_divide_factor(dp_shard)`): the reduce-scatter averages over the shard group and the all-reduce over
the replicate group sums, so every parameter's gradient is dp_replicate times the average."""

from __future__ import annotations

from _dp_avg_plan import hsdp, loss  # noqa: F401


def parallelize(model, ctx):
    model = hsdp(model, ctx)
    shard = ctx.data_mesh()["dp_shard"].size()
    for unit in [*model.blocks, model]:
        unit.set_gradient_divide_factor(float(shard))
    return model
