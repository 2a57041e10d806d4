"""BUG: the process of TP rank 1 dies in the forward (think: a segfault in a kernel)."""

from distributed_impl.model_utils import *  # noqa: F401,F403  everything else is the real implementation
import os

import torch.distributed as dist

from distributed_impl import model_utils as good


class DistributedLogprob(good.DistributedLogprob):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, vocab_start_index, vocab_end_index, group, inference_only=False):
        if dist.get_rank(group) == 1:
            os._exit(13)
        return good.DistributedLogprob.forward(ctx, vocab_parallel_logits, target, vocab_start_index, vocab_end_index,
                                               group, inference_only)
