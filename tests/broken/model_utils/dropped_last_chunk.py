"""BUG: the forward's chunk loop only visits whole chunks, so a last partial chunk is never computed
(left 0).  Everything else, the backward and the collectives included, is the real implementation."""

import sys
from pathlib import Path

from shardcheck.distributed_impl import model_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


def _full_chunks(S, chunk_size):
    return [(s0, s0 + chunk_size) for s0 in range(0, S - chunk_size + 1, chunk_size)]


class ChunkedDistributedLogprob(good.ChunkedDistributedLogprob):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, vocab_start_index, vocab_end_index, chunk_size, tp_group,
                inference_only=False):
        all_chunks, good._chunks = good._chunks, _full_chunks  # the real forward, whole chunks only, for this call
        try:
            return good.ChunkedDistributedLogprob.forward(ctx, vocab_parallel_logits, target, vocab_start_index,
                                                          vocab_end_index, chunk_size, tp_group, inference_only)
        finally:
            good._chunks = all_chunks


export_real_module(globals(), "model_utils", ChunkedDistributedLogprob=ChunkedDistributedLogprob)
