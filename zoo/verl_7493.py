"""verl#7493: fsdp_size=1 on several GPUs silently turns gradient synchronization off.

verl builds a 2-D (replicate, shard) device mesh and picks HYBRID_SHARD; with fsdp_size=1 the shard dim has size 1,
FSDP1 clamps the strategy to NO_SHARD and reduces the gradients over the size-1 shard group only, so the replicas
never synchronize (pytorch#154888, closed as not planned).  Port, in the zoo's sum convention (zoo/_llama.py): the
decoder at dp 2 split replicate 2 x shard 1 (`ctx.data_mesh()`).  Broken: FSDP on the shard group alone, the group
NO_SHARD reduces over (one rank: no reduction); fixed: a 1-D FSDP mesh over every data-parallel rank, the fallback
of verl PR #7494 when the shard dim has size 1."""

from __future__ import annotations

from _llama import fully_shard_on, model_case, sum_gradients, summand, token_losses
from _twins import twins, variant

from shardcheck.harness.core.zoo_bug import BROKEN, FIXED, Bug

FAMILY = "verl_7493"
IMPLEMENTATION = __file__

BUG = Bug(
    thread="verl-project/verl#7493",
    url="https://github.com/verl-project/verl/issues/7493",
    title="fsdp_size=1 degenerates HYBRID_SHARD to NO_SHARD with no reduction over the replicas",
    symptom="replicas train on their own data and drift apart; first seen in production on verl 0.8.0 "
    "(3 trainer + 1 rollout GPU)",
    time_to_find="reported 2026-08-20; fix PR #7494 the same day, closed unmerged ('a rare case')",
    fix="verl PR #7494 (closed): fall back to a 1-D FSDP mesh when the shard dim has size 1",
    topology="dp=2,cp=1,tp=1,dp_replicate=2",
    names=("dparam",),  # every parameter's gradient, none reduced over the replicas
    related=("pytorch/pytorch#154888", "verl-project/verl#7494"),
)


def _shard_group_only(ctx):
    return ctx.data_mesh()["dp_shard"]


def _one_dim_fallback(ctx):
    return ctx.mesh["dp"]


get_sharding_mesh = {BROKEN: _shard_group_only, FIXED: _one_dim_fallback}


def parallelize(model, ctx):
    fully_shard_on(model, ctx.impl.get_sharding_mesh[variant(ctx)](ctx))
    sum_gradients(model)
    return model


def _loss(logits, inputs, ctx):
    return token_losses(logits, inputs["targets"]).mean() if ctx is None else summand(logits, inputs, ctx)


def cases(quick: bool = False) -> list:
    def make(v, where):
        return model_case(f"{FAMILY}.get_sharding_mesh", v, where, parallelize, _loss, hsdp=True)

    return twins(BUG, make)
