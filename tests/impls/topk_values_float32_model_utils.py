"""distributed_vocab_topk returning its values in float32 whatever the logits' dtype, as NeMo-RL's does: the values
are torch.topk's rounded to float32 exactly, the ids right.  The seed states no dtype for the values: a precision
warning under our rule (float64 computed in float32), not a wrong value."""

import sys
from pathlib import Path

from shardcheck.distributed_impl import model_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/
from real_module import export_real_module  # noqa: E402


def distributed_vocab_topk(vocab_parallel_logits, k, tp_group, *, vocab_start_index, vocab_end_index, chunk_size=None):
    values, ids = good.distributed_vocab_topk(
        vocab_parallel_logits,
        k,
        tp_group,
        vocab_start_index=vocab_start_index,
        vocab_end_index=vocab_end_index,
        chunk_size=chunk_size,
    )
    return values.float(), ids


export_real_module(globals(), "model_utils", distributed_vocab_topk=distributed_vocab_topk)
