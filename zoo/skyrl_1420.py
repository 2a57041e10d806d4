"""NovaSky-AI/SkyRL#1420: metrics double-counted across context-parallel ranks.

After SkyRL's loss refactor the Megatron path all-reduced its metrics (sum_loss_metrics=True) over the data-parallel
group *with* context parallelism, but the log-probs were already gathered over CP before the loss, so every CP rank
held the same complete metric and the sum doubled it: policy_loss -57.36 under Megatron against -28.43 under FSDP at
TP 2 x CP 2.  Port: each rank's metric is its DP rank's complete loss (the same on every CP and TP rank); the logged
value is the sum over the data-parallel ranks.  Broken: summed over dp x cp; fixed: over dp alone (the PR's
get_data_parallel_group(with_context_parallel=False)).  Named right: the op's one output (`forward`) and no more:
the metric is one number, the same on every rank, so the finding can name neither an element nor a rank (all four
fail); its values show the factor (got = 2 x expected, the CP size), which the harness names only for a model step
(harness/findings/common_factor.py), not for an op's single output."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _twins import twins, variant

from shardcheck import Case, Layout, Shard
from shardcheck.harness.core.zoo_bug import BROKEN, FIXED, Bug

FAMILY = "skyrl_1420"
IMPLEMENTATION = __file__

BUG = Bug(
    thread="NovaSky-AI/SkyRL#1420",
    url="https://github.com/NovaSky-AI/SkyRL/pull/1420",
    title="metrics complete on every CP rank summed over the DP x CP group",
    symptom="test_megatron_train[tp2_cp2...] failing: policy_loss -57.36 under Megatron against -28.43 under FSDP "
    "(about 2x)",
    time_to_find="introduced by the loss refactor #1296, found by its CI test and fixed in #1420 (2026-03-31)",
    fix="NovaSky-AI/SkyRL PR #1420 (metrics all-reduced over DP without CP)",
    topology="dp=2,cp=2,tp=1",
    names=("forward",),
)


def _over_dp_and_cp(metric, ctx):
    metric = metric.clone()
    dist.all_reduce(metric, group=ctx.mesh["dp", "cp"]._flatten("dp_cp").get_group())
    return metric


def _over_dp(metric, ctx):
    metric = metric.clone()
    dist.all_reduce(metric, group=ctx.group("dp"))
    return metric


all_reduce_metrics = {BROKEN: _over_dp_and_cp, FIXED: _over_dp}


def _make_inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {"sample_loss": torch.randn(4, generator=gen, dtype=torch.float64)}


def _run(impl, ctx, inputs):
    # this DP rank's samples' loss, complete on each of its CP ranks (the log-probs were gathered over CP first)
    return impl.all_reduce_metrics[variant(ctx)](inputs["sample_loss"].sum(), ctx)


def _case(v: str, where: dict) -> Case:
    return Case(
        op=f"{FAMILY}.all_reduce_metrics",
        case_id=v,
        make_inputs=_make_inputs,
        reference=lambda inputs: inputs["sample_loss"].sum(),
        run=_run,
        input_layouts={"sample_loss": Layout(dp=Shard(0))},
        output_names=("policy_loss",),
        context_parallel=True,  # every CP rank holds the same metric: what the bug sums
        **where,
    )


def cases(quick: bool = False) -> list:
    return twins(BUG, _case)
