"""BROKEN PLAN (a suite: --suite-path): Transformers' Qwen3-MoE under its expert-parallel plan with the "all_reduce"
implementation (each rank runs its own experts on the batch the EP group shares and the outputs are summed), but the
router weights' gradient never summed over EP: Transformers' AllReduceEP wraps `top_k_weights` in an all-reduce of
the backward, this one does not.  Each rank's gradient of the routing weights is then only its own experts' share,
so the forward is right and the first divergence is the gradient at the router, `model.layers.1.mlp.gate` (the last
MoE layer's, first in backward order)."""

from __future__ import annotations

from shardcheck.suites.hf import case

FAMILY = "hf"
NAME = "all_reduce_router_grad_not_reduced"


def register() -> None:
    """Register the broken EP implementation with Transformers (on the rank, before the plan)."""
    import torch
    from transformers.distributed.expert_parallel import (
        AllReduceEP,
        EPImplementationInterface,
        _AllReduceBackward,
        _AllReduceForward,
    )

    class RouterGradNotReduced(AllReduceEP):
        def __call__(self, hidden_states, top_k_index, top_k_weights):
            ep_group = self.ep_mesh.get_group()
            hidden_states = _AllReduceBackward.apply(hidden_states, ep_group)
            # the bug: top_k_weights is not wrapped, its gradient stays this rank's experts' share
            off_rank = (top_k_index // self.num_local_experts) != self.ep_mesh.get_local_rank()
            local_index = torch.where(off_rank, self.num_local_experts, top_k_index % self.num_local_experts)
            out = self.experts_forward(hidden_states, local_index, top_k_weights.masked_fill(off_rank, 0.0))
            return _AllReduceForward.apply(out, ep_group)

    EPImplementationInterface.register(NAME, RouterGradNotReduced)


def cases(quick: bool = False):
    return [
        case(
            "qwen3_moe",
            expert_parallel=True,
            case_id="qwen3_moe-ep-router-grad-not-reduced",
            ep_implementation=NAME,
            before=register,
        )
    ]
