"""An independently written model_utils, honest and correct, with two design differences from ours:

- float64 inputs are computed in float32 (the kernels it was written for have no float64 path) and
  the results cast back to float64: about 1e-7 relative error instead of 1e-16;
- every forward of its log-prob ops first checks that the TP ranks agree on the batch and sequence
  shape of their logits: one all-reduce more than shardcheck's contracts allow.

shardcheck should report both as warnings (float64 computed in float32; more collectives than the
contract allows) and pass the run, failing it only under --strict."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardcheck.distributed_impl import model_utils as _base

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/
from real_module import export_real_module  # noqa: E402


def _compute(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.dtype == torch.float64 else x


def _ranks_agree(logits: torch.Tensor, group: dist.ProcessGroup) -> None:
    """The extra collective: every TP rank holds logits for the same batch and sequence positions."""
    b, s = logits.shape[0], logits.shape[1]
    agreed = torch.tensor([b, -b, s, -s], dtype=torch.float32, device=logits.device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    if agreed[0] != -agreed[1] or agreed[2] != -agreed[3]:
        raise ValueError("TP ranks hold logits of different batch or sequence shapes")


class DistributedLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, vocab_start_index, vocab_end_index, group, inference_only=False):
        _ranks_agree(vocab_parallel_logits, group)
        ctx.out_dtype = vocab_parallel_logits.dtype
        out = _base.DistributedLogprob.forward(ctx, _compute(vocab_parallel_logits), target, vocab_start_index,
                                               vocab_end_index, group, inference_only)
        return out.to(torch.promote_types(ctx.out_dtype, out.dtype))

    @staticmethod
    def backward(ctx, grad_output):
        grad, *rest = _base.DistributedLogprob.backward(ctx, _compute(grad_output))
        return (grad.to(ctx.out_dtype), *rest)


class ChunkedDistributedLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, vocab_start_index, vocab_end_index, chunk_size, tp_group,
                inference_only=False):
        _ranks_agree(vocab_parallel_logits, tp_group)
        ctx.out_dtype = vocab_parallel_logits.dtype
        out = _base.ChunkedDistributedLogprob.forward(ctx, _compute(vocab_parallel_logits), target, vocab_start_index,
                                                      vocab_end_index, chunk_size, tp_group, inference_only)
        return out.to(torch.promote_types(ctx.out_dtype, out.dtype))

    @staticmethod
    def backward(ctx, grad_output):
        grad, *rest = _base.ChunkedDistributedLogprob.backward(ctx, _compute(grad_output))
        return (grad.to(ctx.out_dtype), *rest)


export_real_module(globals(), "model_utils", DistributedLogprob=DistributedLogprob,
                   ChunkedDistributedLogprob=ChunkedDistributedLogprob)
