"""BUG: ChunkedDistributedEntropy returns the Shannon entropy -sum p log p (>= 0) instead of sum p log p (<= 0)."""

import sys
from pathlib import Path

from shardcheck.distributed_impl import model_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


class ChunkedDistributedEntropy(good.ChunkedDistributedEntropy):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, chunk_size, tp_group, inference_only=False):
        return -good.ChunkedDistributedEntropy.forward(ctx, vocab_parallel_logits, chunk_size, tp_group, inference_only)

    @staticmethod
    def backward(ctx, *grad_outputs):
        grad, *rest = good.ChunkedDistributedEntropy.backward(ctx, *grad_outputs)
        return (-grad, *rest)  # consistent with the (wrong) forward


export_real_module(globals(), "model_utils", ChunkedDistributedEntropy=ChunkedDistributedEntropy)
