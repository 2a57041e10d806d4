"""BUG: the next-token shift is done inside each CP shard (after taking this rank's tokens) instead of
over the whole sequence, so the last position of every chunk scores the wrong token."""

from distributed_impl.model_utils import *  # noqa: F401,F403  everything else is the real implementation
from distributed_impl.model_utils import _get_tokens_on_this_cp_rank  # noqa: F401  (not in import *)
import torch

from distributed_impl import model_utils as good


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
