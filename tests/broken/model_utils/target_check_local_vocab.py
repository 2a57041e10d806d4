"""Bug: the log-prob ops validate target ids against this rank's piece of the vocabulary instead of the whole
vocabulary, so at tp ≥ 2 valid ids of another rank's piece raise.  The same check also refuses the −100 ids of
masked positions (which the seed leaves open: alone, that would be acceptable, a warn under --impl), with the same
ValueError at the same line: one root, one `error` line, not an error line beside a warn line."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from shardcheck.distributed_impl import model_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


def _ids_in_vocab(target: torch.Tensor, vocab_parallel_logits: torch.Tensor) -> None:
    vocab = vocab_parallel_logits.shape[-1]  # the bug: the local piece's size taken for the vocabulary's
    if bool(((target < 0) | (target >= vocab)).any()):
        raise ValueError(f"target ids must lie in [0, {vocab})")


class DistributedLogprob(good.DistributedLogprob):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, vocab_start_index, vocab_end_index, group, inference_only=False):
        _ids_in_vocab(target, vocab_parallel_logits)
        return good.DistributedLogprob.forward(ctx, vocab_parallel_logits, target, vocab_start_index,
                                               vocab_end_index, group, inference_only)


export_real_module(globals(), "model_utils", DistributedLogprob=DistributedLogprob)
