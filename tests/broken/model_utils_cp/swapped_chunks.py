"""BUG: a CP rank's two head-tail chunks are taken in the wrong order (chunk 2·CP−1−r before chunk r)."""

import sys
from pathlib import Path

import torch

from shardcheck.distributed_impl import model_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


def _get_tokens_on_this_cp_rank(input_ids, cp_rank, cp_size, seq_dim=1):
    if cp_size == 1:
        return input_ids
    chunks = input_ids.chunk(2 * cp_size, dim=seq_dim)
    return torch.cat([chunks[2 * cp_size - 1 - cp_rank], chunks[cp_rank]], dim=seq_dim)


def from_parallel_logits_to_logprobs(vocab_parallel_logits, target, vocab_start_index, vocab_end_index, tp_group,
                                     inference_only=False, cp_group=None, chunk_size=None, sampling_params=None):
    cp_size, cp_rank = good._cp_size_rank(cp_group)
    positions = good._head_tail_positions(vocab_parallel_logits.shape[1] * cp_size, cp_size)
    half = positions.shape[1] // 2
    swapped = torch.cat([positions[:, half:], positions[:, :half]], dim=1)
    return good._next_token_logprobs(vocab_parallel_logits, target, swapped, cp_group, cp_rank, vocab_start_index,
                                     vocab_end_index, tp_group, inference_only, chunk_size, sampling_params)


export_real_module(globals(), "model_utils", _get_tokens_on_this_cp_rank=_get_tokens_on_this_cp_rank,
                   from_parallel_logits_to_logprobs=from_parallel_logits_to_logprobs)
