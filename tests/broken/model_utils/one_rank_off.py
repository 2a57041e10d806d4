"""BUG: TP rank 1 returns values off by one part in a million (a rank-local rounding slip)."""

from distributed_impl.model_utils import *  # noqa: F401,F403  everything else is the real implementation
import torch.distributed as dist

from distributed_impl import model_utils as good


class DistributedLogprob(good.DistributedLogprob):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, vocab_start_index, vocab_end_index, group, inference_only=False):
        out = good.DistributedLogprob.forward(ctx, vocab_parallel_logits, target, vocab_start_index, vocab_end_index,
                                              group, inference_only)
        return out * (1 + 1e-6) if dist.get_rank(group) == 1 else out
