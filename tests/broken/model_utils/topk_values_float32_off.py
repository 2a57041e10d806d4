"""BUG: distributed_vocab_topk returns its values in float32 (a precision warning alone, see
tests/impls/topk_values_float32_model_utils.py) and one of them a float32 ulp off: a wrong value, a failure whatever
the dtype's rule."""

import sys
from pathlib import Path

import torch

from shardcheck.distributed_impl import model_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
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
    values = values.float()
    values[0, 0, 0] = torch.nextafter(values[0, 0, 0], torch.tensor(float("inf")))  # the bug: one ulp up
    return values, ids


export_real_module(globals(), "model_utils", distributed_vocab_topk=distributed_vocab_topk)
