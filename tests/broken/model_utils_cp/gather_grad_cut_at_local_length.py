"""BUG (a pre-fix NeMo-RL copy's mechanism, issue 42): the CP all-gather of the next-token log-probs is told the
unpadded sequence length to zero the gradient of the padding after it, but is handed this rank's local length:
its backward zeroes the gradient of every position past S/CP, so at cp ≥ 2 the tail chunks get no gradient.  The
module is written for a GPU (the cut is read through a pinned index tensor moved with `.cuda()`) and has the older
signature (the TP group named `group`, no chunk_size or sampling_params), as that copy does; its fixed twin is
gather_grad_whole.py."""

import sys
from pathlib import Path

import torch

from shardcheck.distributed_impl import model_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


class _GatherCPPositions(good._GatherCPPositions):
    @staticmethod
    def forward(ctx, tensor, cp_group, seq_dim, positions):
        ctx.unpadded_seqlen = tensor.shape[seq_dim]  # BUG: this rank's length, not the full unpadded one
        return good._GatherCPPositions.forward(ctx, tensor, cp_group, seq_dim, positions)

    @staticmethod
    def backward(ctx, grad):
        cut = int(torch.tensor([ctx.unpadded_seqlen], device="cpu", pin_memory=True).cuda(non_blocking=True).item())
        grad = grad.clone()
        grad.narrow(ctx.seq_dim, cut, grad.shape[ctx.seq_dim] - cut).zero_()
        return good._GatherCPPositions.backward(ctx, grad)


export_real_module(globals(), "model_utils", _GatherCPPositions=_GatherCPPositions)
_current = from_parallel_logits_to_logprobs  # noqa: F821 (the copy's, gathering through the class above)


def from_parallel_logits_to_logprobs(
    vocab_parallel_logits, target, vocab_start_index, vocab_end_index, group, inference_only=False, cp_group=None
):
    return _current(vocab_parallel_logits, target, vocab_start_index, vocab_end_index, group, inference_only, cp_group)
