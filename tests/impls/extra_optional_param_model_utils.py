"""An independently written model_utils whose DistributedLogprob takes one more, optional parameter after the
seed's (`label_smoothing`, off by default): every caller of the seed API still calls it as the seed, so shardcheck
must report nothing about its signature."""

from __future__ import annotations

import sys
from pathlib import Path

from shardcheck.distributed_impl import model_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/
from real_module import export_real_module  # noqa: E402


class DistributedLogprob(good.DistributedLogprob):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, vocab_start_index, vocab_end_index, group, inference_only=False,
                label_smoothing=0.0):
        if label_smoothing:
            raise NotImplementedError("label smoothing")
        return good.DistributedLogprob.forward(ctx, vocab_parallel_logits, target, vocab_start_index, vocab_end_index,
                                               group, inference_only)

    @staticmethod
    def backward(ctx, *grad_outputs):
        return (*good.DistributedLogprob.backward(ctx, *grad_outputs), None)


export_real_module(globals(), "model_utils", DistributedLogprob=DistributedLogprob)
