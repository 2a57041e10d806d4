"""BUG: get_logprobs_from_vocab_parallel_logits refuses input ids handed as a DTensor, a type the seed documents
('input_ids (torch.Tensor | DTensor)').  A real crash: its findings line is an error, never "raises on input only our
rule feeds" (issue 42, item 3: the only DTensor-ids case used to have masked targets, a rule of ours)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402

from shardcheck.distributed_impl import model_utils as good  # noqa: E402


def get_logprobs_from_vocab_parallel_logits(
    vocab_parallel_logits, input_ids, seq_index=None, chunk_size=None, sampling_params=None
):
    if hasattr(input_ids, "device_mesh"):
        raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
    return good.get_logprobs_from_vocab_parallel_logits(
        vocab_parallel_logits, input_ids, seq_index=seq_index, chunk_size=chunk_size, sampling_params=sampling_params
    )


export_real_module(
    globals(), "model_utils", get_logprobs_from_vocab_parallel_logits=get_logprobs_from_vocab_parallel_logits
)
