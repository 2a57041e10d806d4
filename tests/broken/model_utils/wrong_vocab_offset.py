"""BUG: ranks that do not start at vocab id 0 look their targets up one id too far (off-by-one offset)."""

import sys
from pathlib import Path

from shardcheck.distributed_impl import model_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


class DistributedLogprob(good.DistributedLogprob):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, vocab_start_index, vocab_end_index, group, inference_only=False):
        shift = 1 if vocab_start_index > 0 else 0
        return good.DistributedLogprob.forward(ctx, vocab_parallel_logits, target, vocab_start_index + shift,
                                               vocab_end_index + shift, group, inference_only)


export_real_module(globals(), "model_utils", DistributedLogprob=DistributedLogprob)
