"""pytorch#155903: `set_reduce_scatter_divide_factor` is inconsistent between FSDP and HSDP.

FSDP2 on a 2-D (replicate x shard) mesh applied the custom divide factor to the reduce-scatter over the shard dim
and then still averaged the all-reduce over the replicate dim, so HSDP's gradients came out replicate-size times
smaller than the same model's under FSDP on the flattened mesh with the same factor (the thread's repro: a (2, 4)
mesh against its flattened 1-D mesh, factor 300).  Port, in the zoo's sum convention (each rank's loss its summand
of the global mean, FSDP2 told to divide by 1.0, as zoo/_llama.py's plans do): the decoder under HSDP on the data
mesh replicate 2 x shard 2 (`ctx.data_mesh()`).  Broken: what torch did before the fix with a factor of 1.0, the
replicate-dim average on top: on torch 2.13, whose factor is the whole reduction's, that is a factor of
dp_replicate; fixed: the factor 1.0 applied to the whole HSDP reduction (torch as fixed)."""

from __future__ import annotations

from _llama import fully_shard_on, model_case, sum_gradients, summand, token_losses
from _twins import twins, variant

from shardcheck.harness.core.zoo_bug import BROKEN, FIXED, Bug

FAMILY = "pytorch_155903"
IMPLEMENTATION = __file__

BUG = Bug(
    thread="pytorch/pytorch#155903",
    url="https://github.com/pytorch/pytorch/issues/155903",
    title="HSDP applies the reduce-scatter divide factor and then averages over the replicate dim too",
    symptom="the same model and factor give different gradients under FSDP (1-D mesh) and HSDP (2-D mesh)",
    time_to_find="reported with a repro 2025-06-13; closed",
    fix="closed in pytorch (the divide factor applied to the whole HSDP reduction)",
    topology="dp=4,cp=1,tp=1,dp_replicate=2",
    names=("dparam",),  # every parameter's gradient: the first in the model's order is the finding's
)


def _replicate_average_on_top(model, ctx):
    """torch before the fix: the factor (1.0) on the reduce-scatter, then an average over the replicate group."""
    sum_gradients(model)
    for unit in [*model.layers, model]:
        unit.set_gradient_divide_factor(float(ctx.data_mesh()["dp_replicate"].size()))


def _factor_of_the_whole_reduction(model, ctx):
    sum_gradients(model)


set_gradient_divide_factor = {BROKEN: _replicate_average_on_top, FIXED: _factor_of_the_whole_reduction}


def parallelize(model, ctx):
    fully_shard_on(model, ctx.data_mesh())
    ctx.impl.set_gradient_divide_factor[variant(ctx)](model, ctx)
    return model


def _loss(logits, inputs, ctx):
    return token_losses(logits, inputs["targets"]).mean() if ctx is None else summand(logits, inputs, ctx)


def cases(quick: bool = False) -> list:
    def make(v, where):
        return model_case(f"{FAMILY}.set_gradient_divide_factor", v, where, parallelize, _loss, batch=4, hsdp=True)

    return twins(BUG, make)
