"""BUG: packed sequences are laid out head-tail over the whole pack instead of each sequence on its own
(targets taken and log-probs gathered with the whole-pack rule)."""

import sys
from pathlib import Path

import torch

from shardcheck.distributed_impl import model_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


def from_parallel_logits_to_logprobs_packed_sequences(vocab_parallel_logits, target, cu_seqlens_padded, unpacked_seqlen,
                                                      vocab_start_index, vocab_end_index, group, inference_only=False,
                                                      cp_group=None, chunk_size=None, sampling_params=None,
                                                      target_is_pre_rolled=False):
    cp_size, cp_rank = good._cp_size_rank(cp_group)
    bounds = [int(b) for b in cu_seqlens_padded.tolist()]
    positions = good._head_tail_positions(bounds[-1], cp_size)  # the bug: one rule for the whole pack
    if target_is_pre_rolled:
        local_target = target.long()
    else:
        rolled = torch.cat([target[:, a:b].roll(-1, dims=1) for a, b in zip(bounds[:-1], bounds[1:])], dim=1)
        local_target = rolled[:, positions[cp_rank]].long()
    logprobs = good._vocab_parallel_logprobs(vocab_parallel_logits, local_target, vocab_start_index, vocab_end_index,
                                             group, inference_only, chunk_size, sampling_params)
    logprobs = good._gather_cp(logprobs, cp_group, 1, positions)[0]
    rows = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        row = logprobs[a:b - 1][: unpacked_seqlen - 1]
        rows.append(torch.nn.functional.pad(row, (0, unpacked_seqlen - 1 - row.shape[0])))
    return torch.stack(rows)


export_real_module(globals(), "model_utils",
                   from_parallel_logits_to_logprobs_packed_sequences=from_parallel_logits_to_logprobs_packed_sequences)
