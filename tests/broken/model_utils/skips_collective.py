"""BUG: TP rank 1 skips the final all-reduce of the picked log-probs, so its peers block in it forever."""

from distributed_impl.model_utils import *  # noqa: F401,F403  everything else is the real implementation
import torch
import torch.distributed as dist

from distributed_impl import model_utils as good


class DistributedLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, vocab_start_index, vocab_end_index, group, inference_only=False):
        log_probs = good._compute_distributed_log_softmax(vocab_parallel_logits, group)
        local_target = (target - vocab_start_index).clamp(0, log_probs.shape[-1] - 1)
        owned = (target >= vocab_start_index) & (target < vocab_end_index)
        picked = torch.where(owned, log_probs.gather(-1, local_target.unsqueeze(-1)).squeeze(-1), 0.0)
        if dist.get_rank(group) != 1:
            dist.all_reduce(picked, group=group)
        return picked
