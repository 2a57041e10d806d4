"""Honest: input ids handed as a DTensor are made whole with `full_tensor()`, as NeMo-RL's front ends do.  That is right
when the DTensor is on the cp/tp sub-mesh its callers build it on (each DP rank's DTensor is its own batch piece); a
harness that built it on the whole mesh with DP Shard(0) would hand it the global batch (issue 42, item 4)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/
from real_module import export_real_module  # noqa: E402

from shardcheck.distributed_impl import model_utils as good  # noqa: E402


def get_logprobs_from_vocab_parallel_logits(
    vocab_parallel_logits, input_ids, seq_index=None, chunk_size=None, sampling_params=None
):
    if hasattr(input_ids, "full_tensor") and seq_index is None:
        input_ids = input_ids.full_tensor()
    return good.get_logprobs_from_vocab_parallel_logits(
        vocab_parallel_logits, input_ids, seq_index=seq_index, chunk_size=chunk_size, sampling_params=sampling_params
    )


export_real_module(
    globals(), "model_utils", get_logprobs_from_vocab_parallel_logits=get_logprobs_from_vocab_parallel_logits
)
