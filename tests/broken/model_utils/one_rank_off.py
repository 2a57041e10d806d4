"""BUG: TP rank 1 returns values off by one part in a million (a rank-local rounding slip)."""

import sys
from pathlib import Path

import torch.distributed as dist

from shardcheck.distributed_impl import model_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


class DistributedLogprob(good.DistributedLogprob):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, vocab_start_index, vocab_end_index, group, inference_only=False):
        out = good.DistributedLogprob.forward(ctx, vocab_parallel_logits, target, vocab_start_index, vocab_end_index,
                                              group, inference_only)
        return out * (1 + 1e-6) if dist.get_rank(group) == 1 else out


export_real_module(globals(), "model_utils", DistributedLogprob=DistributedLogprob)
