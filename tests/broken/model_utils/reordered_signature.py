"""BUG (API drift): ChunkedDistributedLogprob.forward takes (..., tp_group, chunk_size, ...) where the seed
API has (..., chunk_size, tp_group, ...).  Callers of the seed API passing them positionally break.
The values are right: shardcheck reports one signature finding and, calling by keyword, checks the rest."""

from distributed_impl.model_utils import *  # noqa: F401,F403  everything else is the real implementation
from distributed_impl import model_utils as good


class ChunkedDistributedLogprob(good.ChunkedDistributedLogprob):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, vocab_start_index, vocab_end_index, tp_group, chunk_size,
                inference_only=False):
        return good.ChunkedDistributedLogprob.forward(ctx, vocab_parallel_logits, target, vocab_start_index,
                                                      vocab_end_index, chunk_size, tp_group, inference_only)
