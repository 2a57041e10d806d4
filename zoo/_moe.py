"""What the zoo's expert-parallel entries share: the MoE decoder's step (reference/moe.py, the moe family's suite and
plan, docs/ops/moe.md) as a pair's ModelCase, whose gradient reduction each entry writes as its project had it.

- `model_case`: the decoder's step at the bug's topology, experts over ep (their hidden dim over tp), the batch over
  dp, `parallelize` and `loss` taken from the entry's module (`ctx.impl`).
- `shard`: the family's own expert sharding and expert-parallel MoE layer (dispatch, experts, combine), no gradient
  reduction: each entry adds its own.
- `reduce_grads`: every parameter's gradient all-reduced over its groups and divided by a divisor as it is
  accumulated (the dense ones and the experts' each by their own rule: the place the threads' bugs were)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from shardcheck import ModelCase
from shardcheck.distributed_impl import moe as ours
from shardcheck.reference import moe as ref
from shardcheck.suites import moe as suite


def shard(model: nn.Module, ctx) -> None:
    """The family's plan without its gradient reduction: this rank's experts, the expert-parallel MoE layer."""
    ours.shard_experts(model.layer.moe.experts, ctx)
    model.layer.moe = ours.ExpertParallelMoE(model.layer.moe, ctx)


def is_expert(name: str) -> bool:
    return ".experts." in name


def reduce_grads(model: nn.Module, rule: Callable[[str], tuple[list, float]]) -> None:
    """Each parameter's gradient summed over the groups `rule(name)` gives, then divided by its divisor."""

    def hook(groups: list, divisor: float):
        def reduce(p: torch.Tensor) -> None:
            for group in groups:
                dist.all_reduce(p.grad, group=group)
            if divisor != 1.0:
                p.grad.div_(divisor)

        return reduce

    for name, p in model.named_parameters():
        groups, divisor = rule(name)
        if groups or divisor != 1.0:
            p.register_post_accumulate_grad_hook(hook(groups, divisor))


def _inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {"tokens": torch.randint(0, suite.CONFIG.vocab, (suite.MODEL_BATCH, suite.SEQ), generator=gen)}


def _loss(outputs, inputs, ctx) -> torch.Tensor:
    if ctx is None:
        logits, aux = outputs
        return ref.loss(logits, aux, inputs["tokens"], suite.CONFIG.aux_coef)
    return ctx.impl.loss(outputs, inputs["tokens"], ctx)  # the entry's convention


def model_case(op: str, variant: str, where: dict) -> ModelCase:
    """The pair's case `variant` of the MoE decoder's step (`where`: its dtypes, topology and params)."""
    return ModelCase(
        op=op,
        case_id=variant,
        build=lambda gen: ref.build(suite.CONFIG, gen),
        parallelize=lambda model, ctx: ctx.impl.parallelize(model, ctx),
        make_inputs=_inputs,
        loss=_loss,
        input_layouts={"tokens": suite.BATCH},
        param_layouts=dict(suite.EXPERT_LAYOUTS),
        expert_parallel=True,
        **where,
    )
