"""BUG (bfloat16, huge logits only): the saturated-softmax path of DistributedLogprob's backward
(rows whose softmax puts 99% on one token, as x100 logits do) masks the -100 targets with a
*soft* mask: their rows keep 2^-8 of the unmasked gradient (-upstream * softmax) instead of exact 0.

Small beside the tensor's largest gradients, it passed the old tensor-wide budget (err/budget ~0.1);
per-row budgets give rows whose golden and reference gradients are exact zeros a budget of 0."""

import sys
from pathlib import Path

import torch

from shardcheck.distributed_impl import model_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


SOFT_MASK = 2.0 ** -8


class DistributedLogprob(good.DistributedLogprob):
    @staticmethod
    def backward(ctx, *grad_outputs):
        grad, *rest = good.DistributedLogprob.backward(ctx, *grad_outputs)
        if ctx.input_dtype != torch.bfloat16:
            return (grad, *rest)
        softmax, _, valid = ctx.saved_tensors
        saturated = softmax.amax(-1) > 0.99  # this vocab shard holds a token with all but 1% of the mass
        unmasked = -grad_outputs[0].unsqueeze(-1).to(softmax.dtype) * softmax
        masked = (~valid.bool() & saturated).unsqueeze(-1)
        return (torch.where(masked, (SOFT_MASK * unmasked).to(grad.dtype), grad), *rest)


export_real_module(globals(), "model_utils", DistributedLogprob=DistributedLogprob)
