"""BUG (communication only): DistributedLogprob all-gathers the local vocab-parallel logits, a full
[B, S, V] tensor on every TP rank that nothing needs, then calls the real op. Values and gradients are
right; only `property:comm` can catch it (an all_gather@tp the contract does not allow)."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardcheck.distributed_impl import model_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


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


export_real_module(globals(), "model_utils", DistributedLogprob=DistributedLogprob)
