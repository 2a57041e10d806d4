"""BUG: TP rank 1 raises in the forward (say, a shape assertion only its shard trips); its peers block."""

from distributed_impl.model_utils import *  # noqa: F401,F403  everything else is the real implementation
import torch.distributed as dist

from distributed_impl import model_utils as good


class DistributedLogprob(good.DistributedLogprob):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, vocab_start_index, vocab_end_index, group, inference_only=False):
        if dist.get_rank(group) == 1:
            raise RuntimeError(f"shard check failed on vocab [{vocab_start_index}, {vocab_end_index})")
        return good.DistributedLogprob.forward(ctx, vocab_parallel_logits, target, vocab_start_index, vocab_end_index,
                                               group, inference_only)
