"""Bug: the autograd-aware gather averages the ranks' gradients instead of summing them (a reduce-scatter
with AVG), so every passage gradient is 1/world of the single-device one."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardcheck.distributed_impl import inbatch_neg_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


class _GatherAveraged(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        out = t.new_empty((dist.get_world_size() * t.shape[0], *t.shape[1:]))
        good._all_gather_single(out, t.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        grad_local = grad.new_empty((grad.shape[0] // dist.get_world_size(), *grad.shape[1:]))
        good._reduce_scatter_single(grad_local, grad.contiguous())
        return grad_local / dist.get_world_size()


def _gather(t, preserve_grad=False):
    if preserve_grad and t.requires_grad:
        return _GatherAveraged.apply(t)
    return good._all_gather_tensor(t, preserve_grad)


def dist_gather_tensor(t, preserve_grad=False):
    if t is None or t.ndim == 0 or not good._gathering():  # None, bad shapes, a world of 1: as the correct one
        return good.dist_gather_tensor(t, preserve_grad)
    return _gather(t, preserve_grad)


export_real_module(globals(), "inbatch_neg_utils", dist_gather_tensor=dist_gather_tensor)
