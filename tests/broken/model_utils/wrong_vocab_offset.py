"""BUG: ranks that do not start at vocab id 0 look their targets up one id too far (off-by-one offset)."""

from distributed_impl.model_utils import *  # noqa: F401,F403  everything else is the real implementation
import torch.distributed as dist

from distributed_impl import model_utils as good


class DistributedLogprob(good.DistributedLogprob):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, vocab_start_index, vocab_end_index, group, inference_only=False):
        shift = 1 if vocab_start_index > 0 else 0
        return good.DistributedLogprob.forward(ctx, vocab_parallel_logits, target, vocab_start_index + shift,
                                               vocab_end_index + shift, group, inference_only)
