"""BUG: correct values, but the backward multiplies the logits gradient by the TP group size
(as if the replicated output's gradient had been all-reduced again)."""

import sys
from pathlib import Path

import torch.distributed as dist

from shardcheck.distributed_impl import model_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


class DistributedLogprob(good.DistributedLogprob):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, vocab_start_index, vocab_end_index, group, inference_only=False):
        ctx.tp_size = dist.get_world_size(group)
        return good.DistributedLogprob.forward(ctx, vocab_parallel_logits, target, vocab_start_index, vocab_end_index,
                                               group, inference_only)

    @staticmethod
    def backward(ctx, *grad_outputs):
        grad_logits, *rest = good.DistributedLogprob.backward(ctx, *grad_outputs)
        return (grad_logits * ctx.tp_size, *rest)


export_real_module(globals(), "model_utils", DistributedLogprob=DistributedLogprob)
