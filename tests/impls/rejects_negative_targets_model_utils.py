"""An independently written model_utils, honest, that refuses target ids below 0 with a clear ValueError instead of
masking them (the seed does not say what a −100 target means; our cases that feed them are judged by a rule of
ours, docs/ops/README.md#conventions-shared-by-every-family).  Otherwise it is correct.

By "loud or right" that refusal is acceptable: under --impl its findings line is a `warn` naming our rule, the
run exits 0 (1 under --strict)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from shardcheck.distributed_impl import model_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/
from real_module import export_real_module  # noqa: E402


def _require_token_ids(target: torch.Tensor) -> None:
    if bool((target < 0).any()):
        raise ValueError(f"target holds {int((target < 0).sum())} negative id(s): mask them before calling")


class DistributedLogprob(good.DistributedLogprob):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, vocab_start_index, vocab_end_index, group, inference_only=False):
        _require_token_ids(target)
        return good.DistributedLogprob.forward(ctx, vocab_parallel_logits, target, vocab_start_index,
                                               vocab_end_index, group, inference_only)


class ChunkedDistributedLogprob(good.ChunkedDistributedLogprob):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, vocab_start_index, vocab_end_index, chunk_size, tp_group,
                inference_only=False):
        _require_token_ids(target)
        return good.ChunkedDistributedLogprob.forward(ctx, vocab_parallel_logits, target, vocab_start_index,
                                                      vocab_end_index, chunk_size, tp_group, inference_only)


export_real_module(globals(), "model_utils", DistributedLogprob=DistributedLogprob,
                   ChunkedDistributedLogprob=ChunkedDistributedLogprob)
