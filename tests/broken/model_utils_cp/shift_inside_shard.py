"""BUG: the next-token shift is done inside each CP shard (after taking this rank's tokens) instead of
over the whole sequence, so the last position of every chunk scores the wrong token."""

import sys
from pathlib import Path

import torch

from shardcheck.distributed_impl import model_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


def from_parallel_logits_to_logprobs(vocab_parallel_logits, target, vocab_start_index, vocab_end_index, tp_group,
                                     inference_only=False, cp_group=None, chunk_size=None, sampling_params=None):
    cp_size, cp_rank = good._cp_size_rank(cp_group)
    seq_len = vocab_parallel_logits.shape[1] * cp_size
    padded = torch.nn.functional.pad(target, (0, seq_len - target.shape[1]))
    local = good._get_tokens_on_this_cp_rank(padded, cp_rank, cp_size).roll(shifts=-1, dims=-1)
    logprobs = good._vocab_parallel_logprobs(vocab_parallel_logits, local, vocab_start_index, vocab_end_index, tp_group,
                                             inference_only, chunk_size, sampling_params)
    if cp_size > 1:
        logprobs = good.allgather_cp_sharded_tensor(logprobs, cp_group)
    return logprobs[:, : target.shape[1] - 1].contiguous()


export_real_module(globals(), "model_utils", from_parallel_logits_to_logprobs=from_parallel_logits_to_logprobs)
