"""BUG (communication only): DistributedLogprob all-gathers the local vocab-parallel logits, a full
[B, S, V] tensor on every TP rank that nothing needs, then calls the real op. Values and gradients are
right; only `property:comm` can catch it (an all_gather@tp the contract does not allow)."""

from distributed_impl.model_utils import *  # noqa: F401,F403  everything else is the real implementation
import torch
import torch.distributed as dist

from distributed_impl import model_utils as good


class DistributedLogprob:
    @staticmethod
    def apply(vocab_parallel_logits, target, vocab_start_index, vocab_end_index, group, inference_only=False):
        # The wasted gather. Shards are torch.chunk pieces (rank r starts at r * width), padded to the
        # widest so that every rank hands the all-gather the same size.
        rank = dist.get_rank(group)
        width = vocab_start_index // rank if rank else vocab_end_index
        local = vocab_parallel_logits.detach()
        local = torch.nn.functional.pad(local, (0, width - local.shape[-1])).contiguous()
        gathered = torch.empty(dist.get_world_size(group) * local.numel(), dtype=local.dtype, device=local.device)
        dist.all_gather_into_tensor(gathered, local.view(-1), group=group)
        return good.DistributedLogprob.apply(vocab_parallel_logits, target, vocab_start_index, vocab_end_index,
                                             group, inference_only)
