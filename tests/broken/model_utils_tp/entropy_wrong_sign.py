"""BUG: ChunkedDistributedEntropy returns the Shannon entropy -sum p log p (>= 0) instead of sum p log p (<= 0)."""

from distributed_impl.model_utils import *  # noqa: F401,F403  everything else is the real implementation

from distributed_impl import model_utils as good


class ChunkedDistributedEntropy(good.ChunkedDistributedEntropy):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, chunk_size, tp_group, inference_only=False):
        return -good.ChunkedDistributedEntropy.forward(ctx, vocab_parallel_logits, chunk_size, tp_group, inference_only)

    @staticmethod
    def backward(ctx, *grad_outputs):
        grad, *rest = good.ChunkedDistributedEntropy.backward(ctx, *grad_outputs)
        return (-grad, *rest)  # consistent with the (wrong) forward
