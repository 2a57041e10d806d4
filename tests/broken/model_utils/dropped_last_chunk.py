"""BUG: the forward's chunk loop only visits whole chunks, so a last partial chunk is never computed
(left 0).  Everything else, the backward and the collectives included, is the real implementation."""

import importlib.util
from pathlib import Path

from distributed_impl.model_utils import *  # noqa: F401,F403  everything else is the real implementation

# A private copy of the real module: its functions look module-level names up at call time, so the
# forward below can swap its chunk list without touching distributed_impl.model_utils itself.
_spec = importlib.util.spec_from_file_location(
    "_model_utils_dropped_last_chunk", Path(__file__).resolve().parents[3] / "distributed_impl" / "model_utils.py")
_m = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_m)
_all_chunks = _m._chunks


def _full_chunks(S, chunk_size):
    return [(s0, s0 + chunk_size) for s0 in range(0, S - chunk_size + 1, chunk_size)]


class ChunkedDistributedLogprob(_m.ChunkedDistributedLogprob):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, vocab_start_index, vocab_end_index, chunk_size, tp_group,
                inference_only=False):
        _m._chunks = _full_chunks
        try:
            return _m.ChunkedDistributedLogprob.forward(ctx, vocab_parallel_logits, target, vocab_start_index,
                                                        vocab_end_index, chunk_size, tp_group, inference_only)
        finally:
            _m._chunks = _all_chunks
