"""The fix of gather_grad_cut_at_local_length.py: the CP all-gather's backward keeps the whole gradient (the
padding past the target is cut from the forward's result, so its gradient is already zero).  Still written for a
GPU (a pinned index tensor moved with `.cuda()`) and with the older signature, as the fixed upstream copy is."""

import sys
from pathlib import Path

import torch

from shardcheck.distributed_impl import model_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


class _GatherCPPositions(good._GatherCPPositions):
    @staticmethod
    def backward(ctx, grad):
        mine = torch.tensor([0], device="cpu", pin_memory=True).cuda(non_blocking=True)
        return good._GatherCPPositions.backward(ctx, grad + 0 * mine.to(grad.dtype))


export_real_module(globals(), "model_utils", _GatherCPPositions=_GatherCPPositions)
_current = from_parallel_logits_to_logprobs  # noqa: F821 (the copy's, gathering through the class above)


def from_parallel_logits_to_logprobs(
    vocab_parallel_logits, target, vocab_start_index, vocab_end_index, group, inference_only=False, cp_group=None
):
    return _current(vocab_parallel_logits, target, vocab_start_index, vocab_end_index, group, inference_only, cp_group)
