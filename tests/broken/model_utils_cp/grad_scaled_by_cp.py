"""BUG: values right, but the logits gradient comes back multiplied by the CP size (as if the all-gather's
backward summed an all-reduced gradient once more)."""

from distributed_impl.model_utils import *  # noqa: F401,F403  everything else is the real implementation
from distributed_impl.model_utils import _get_tokens_on_this_cp_rank  # noqa: F401  (not in import *)
import torch
import torch.distributed as dist

from distributed_impl import model_utils as good


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
