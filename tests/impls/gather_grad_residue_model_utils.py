"""Honest, to round-off: the gather-log-prob gradient starts from -softmax * sum_k g_k and adds each g_k after it, so
where the softmax is exactly 1 (V = 1) and an id repeats, the true 0 comes out as a rounding residue of sum_k g_k (our
own backward once did this; NeMo-RL's does).  The values are right to the last bits: the residue is within the floor
a golden of exact zeros gets from its upstream gradients' scale (issue 42, item 5), not a wrong value."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/
from real_module import export_real_module  # noqa: E402


def _gather_logprob_grad(softmax, ids, valid, grad_output, vocab_start_index):
    g = torch.where(valid, grad_output.to(softmax.dtype), torch.zeros((), dtype=softmax.dtype))
    grad = softmax * -g.sum(-1, keepdim=True)
    V_local = softmax.shape[-1]
    if V_local == 0:
        return grad
    owned = (ids >= vocab_start_index) & (ids < vocab_start_index + V_local)
    grad.scatter_add_(-1, torch.where(owned, ids - vocab_start_index, 0), torch.where(owned, g, 0.0))
    return grad


export_real_module(globals(), "model_utils", _gather_logprob_grad=_gather_logprob_grad)
