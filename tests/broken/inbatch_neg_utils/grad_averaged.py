"""Bug: the autograd-aware gather averages the ranks' gradients instead of summing them (a reduce-scatter
with AVG), so every passage gradient is 1/world of the single-device one."""

import torch
import torch.distributed as dist

from distributed_impl.inbatch_neg_utils import (  # noqa: F401
    dist_gather_tensor_with_dim1_padding, mask_gathered_passages_same_doc_as_positive)
from distributed_impl import inbatch_neg_utils as _correct


class _GatherAveraged(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        out = t.new_empty((dist.get_world_size() * t.shape[0], *t.shape[1:]))
        dist.all_gather_single(out, t.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        grad_local = grad.new_empty((grad.shape[0] // dist.get_world_size(), *grad.shape[1:]))
        dist.reduce_scatter_single(grad_local, grad.contiguous())
        return grad_local / dist.get_world_size()


def _all_gather_tensor(t, preserve_grad=False):
    if preserve_grad and t.requires_grad:
        return _GatherAveraged.apply(t)
    return _correct._all_gather_tensor(t, preserve_grad)


def dist_gather_tensor(t, preserve_grad=False):
    if t is None or t.ndim == 0 or not _correct._gathering():  # None, bad shapes, a world of 1: as the correct one
        return _correct.dist_gather_tensor(t, preserve_grad)
    return _all_gather_tensor(t, preserve_grad)
