"""An independently written model_utils, honest, that meets two inputs outside the contract differently from ours:

- DistributedCrossEntropy rejects student and target logits of different shapes with an AssertionError (ours
  raises ValueError; the seed names no type);
- the sampling ops (DistributedLogprobWithSampling and its chunked twin) pad B·S rows that TP does not divide
  with zero logits, up to a multiple of TP, instead of refusing them, and return the [B, S] log-probs of the
  real rows (the padding's gradient is dropped with it).

Both are right by "loud or right": shardcheck must pass them (values and gradients of the padded answer)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardcheck.distributed_impl import model_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/
from real_module import export_real_module  # noqa: E402


class DistributedCrossEntropy(good.DistributedCrossEntropy):
    @staticmethod
    def forward(ctx, student_logits, target_logits, group, inference_only=False):
        assert student_logits.shape == target_logits.shape, "student and target logits differ in shape"
        return good.DistributedCrossEntropy.forward(ctx, student_logits, target_logits, group, inference_only)


def _padded_rows(logits: torch.Tensor, target: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, S, V_local] and target [B, S] with zero positions appended until B·S' divides over the group."""
    b, s = target.shape
    tp = dist.get_world_size(group)
    pad = next(p for p in range(tp) if b * (s + p) % tp == 0)
    return F.pad(logits, (0, 0, 0, pad)), F.pad(target, (0, pad))


class DistributedLogprobWithSampling(good.DistributedLogprobWithSampling):
    @classmethod
    def apply(cls, vocab_parallel_logits, target, tp_group, top_k, top_p, inference_only=False):
        logits, padded = _padded_rows(vocab_parallel_logits, target, tp_group)
        return super().apply(logits, padded, tp_group, top_k, top_p, inference_only)[:, :target.shape[1]]


class ChunkedDistributedLogprobWithSampling(good.ChunkedDistributedLogprobWithSampling):
    @classmethod
    def apply(cls, vocab_parallel_logits, target, tp_group, top_k, top_p, chunk_size, inference_only=False):
        logits, padded = _padded_rows(vocab_parallel_logits, target, tp_group)
        return super().apply(logits, padded, tp_group, top_k, top_p, chunk_size, inference_only)[:, :target.shape[1]]


export_real_module(globals(), "model_utils", DistributedCrossEntropy=DistributedCrossEntropy,
                   DistributedLogprobWithSampling=DistributedLogprobWithSampling,
                   ChunkedDistributedLogprobWithSampling=ChunkedDistributedLogprobWithSampling)
