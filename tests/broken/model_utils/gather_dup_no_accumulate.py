"""BUG: the backward of ChunkedDistributedGatherLogprob *assigns* g_k at each index, so duplicate indices do not accumulate."""

import sys
from pathlib import Path

import torch

from shardcheck.distributed_impl import model_utils as good
from shardcheck.distributed_impl.model_utils import _chunks, _compute_distributed_softmax

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


class ChunkedDistributedGatherLogprob(good.ChunkedDistributedGatherLogprob):
    @staticmethod
    def backward(ctx, *grad_outputs):
        logits, ids, valid = ctx.saved_tensors
        grad_input = torch.empty_like(logits)
        start = ctx.vocab_start_index
        for s0, s1 in _chunks(logits.shape[1], ctx.chunk_size):
            softmax = _compute_distributed_softmax(logits[:, s0:s1], ctx.tp_group)
            g = torch.where(valid[:, s0:s1], grad_outputs[0][:, s0:s1].to(softmax.dtype), 0.0)
            base = softmax * -g.sum(-1, keepdim=True)
            grad = base.clone()
            idx = ids[:, s0:s1]
            owned = (idx >= start) & (idx < start + softmax.shape[-1])
            for j in range(idx.shape[-1]):  # the last duplicate wins instead of all of them adding up
                li = torch.where(owned[..., j:j + 1], idx[..., j:j + 1] - start, 0)
                new = base.gather(-1, li) + g[..., j:j + 1]
                grad.scatter_(-1, li, torch.where(owned[..., j:j + 1], new, grad.gather(-1, li)))
            grad_input[:, s0:s1] = grad
        return grad_input, None, None, None, None, None, None


export_real_module(globals(), "model_utils", ChunkedDistributedGatherLogprob=ChunkedDistributedGatherLogprob)
