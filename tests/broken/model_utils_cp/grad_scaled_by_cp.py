"""BUG: values right, but the logits gradient comes back multiplied by the CP size (as if the all-gather's
backward summed an all-reduced gradient once more)."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardcheck.distributed_impl import model_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


def from_parallel_logits_to_logprobs(vocab_parallel_logits, target, vocab_start_index, vocab_end_index, tp_group,
                                     inference_only=False, cp_group=None, chunk_size=None, sampling_params=None):
    cp_size = 1 if cp_group is None else dist.get_world_size(cp_group)
    logits = _ScaleGrad.apply(vocab_parallel_logits, cp_size)
    return good.from_parallel_logits_to_logprobs(logits, target, vocab_start_index, vocab_end_index, tp_group,
                                                 inference_only, cp_group, chunk_size, sampling_params)


export_real_module(globals(), "model_utils", from_parallel_logits_to_logprobs=from_parallel_logits_to_logprobs)
