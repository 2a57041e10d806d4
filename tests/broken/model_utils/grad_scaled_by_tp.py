"""BUG: correct values, but the backward multiplies the logits gradient by the TP group size
(as if the replicated output's gradient had been all-reduced again)."""

from distributed_impl.model_utils import *  # noqa: F401,F403  everything else is the real implementation
import torch.distributed as dist

from distributed_impl import model_utils as good


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
