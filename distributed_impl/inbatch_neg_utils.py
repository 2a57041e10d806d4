"""Sharded implementation of ``nemo_automodel.components.models.common.inbatch_neg_utils``
(semantics: docs/ops/inbatch_neg_utils.md).

Distributed in-batch negatives for bi-encoder contrastive training: every DP rank gathers
the passages of all ranks over the default process group and scores its queries against
them. ``preserve_grad=True`` makes the gather autograd-aware: its backward reduce-scatters
(sums) the gathered tensor's gradient, so rank r's passages receive the gradient of every
rank's loss. Otherwise the remote slices are detached and the local slice is ``t`` itself.
"""

from typing import Optional

import torch
import torch.distributed as dist


def _gathering() -> bool:
    """Whether there is a process group of more than one rank to gather over."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _all_gather_single(out: torch.Tensor, t: torch.Tensor) -> None:
    # torch 2.13 names it all_gather_single (all_gather_into_tensor warns there as deprecated); older torch has only
    # all_gather_into_tensor.  Looked up at each call: whatever wraps the module's collectives is seen.
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, t)


def _reduce_scatter_single(out: torch.Tensor, t: torch.Tensor) -> None:
    # as _all_gather_single: reduce_scatter_single from torch 2.13, reduce_scatter_tensor before
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, t)


class _GatherWithGrad(torch.autograd.Function):
    """All-gather along dim 0; backward: reduce-scatter (sum) of the gradient of the gathered tensor,
    i.e. rank r gets the sum over all ranks of the gradient of its own slice."""

    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:
        out = t.new_empty((dist.get_world_size() * t.shape[0], *t.shape[1:]))
        _all_gather_single(out, t.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad_local = grad.new_empty((grad.shape[0] // dist.get_world_size(), *grad.shape[1:]))
        _reduce_scatter_single(grad_local, grad.contiguous())
        return grad_local


def _all_gather_tensor(t: torch.Tensor, preserve_grad: bool = False) -> torch.Tensor:
    """All-gather t along dim 0, preserving autograd only when needed."""
    if preserve_grad and t.requires_grad:
        return _GatherWithGrad.apply(t)
    pieces = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, t.contiguous())  # detached: no autograd through a plain collective
    if t.requires_grad:
        pieces[dist.get_rank()] = t  # the local slice keeps this rank's own gradient flow
    return torch.cat(pieces, dim=0)


def dist_gather_tensor(t: Optional[torch.Tensor], preserve_grad: bool = False) -> Optional[torch.Tensor]:
    """All-gather t along dim 0 across the default process group.

    None -> None; no process group or a world of 1 -> t unchanged. Tensors that require grad keep
    it: all of it with ``preserve_grad`` (gradients go back to their owning rank), else only through
    the local slice. Tensors without grad (ids, masks) get a plain detached gather.
    """
    if t is None:
        return None
    if t.ndim == 0:
        raise ValueError("dist_gather_tensor gathers along dim 0: t must have at least 1 dim, got a 0-dim tensor")
    if not _gathering():
        return t
    return _all_gather_tensor(t, preserve_grad)


def dist_gather_tensor_with_dim1_padding(
    t: Optional[torch.Tensor], padding_value: int | float | bool = 0, preserve_grad: bool = False
) -> Optional[torch.Tensor]:
    """All-gather t after right-padding dim 1 with `padding_value` to the largest dim 1 over ranks."""
    if t is None:
        return None
    if t.ndim < 2:
        raise ValueError(
            f"dist_gather_tensor_with_dim1_padding pads dim 1: t must have at least 2 dims, got shape {tuple(t.shape)}"
        )
    if not _gathering():
        return t
    longest = torch.tensor([t.shape[1]], dtype=torch.int64, device=t.device)
    dist.all_reduce(longest, op=dist.ReduceOp.MAX)
    missing = int(longest) - t.shape[1]
    if missing:
        fill = torch.full((t.shape[0], missing, *t.shape[2:]), padding_value, dtype=t.dtype, device=t.device)
        t = torch.cat([t, fill], dim=1)
    return _all_gather_tensor(t, preserve_grad)


def _check_mask_args(
    scores: torch.Tensor, passage_doc_ids: torch.Tensor, train_n_passages: int, rank: int, local_batch_size: int
) -> None:
    if scores.ndim != 2:
        raise ValueError(
            f"scores must be 2-D [local_batch_size, B_global * train_n_passages], got shape {tuple(scores.shape)}"
        )
    if passage_doc_ids.ndim != 1 or passage_doc_ids.shape[0] != scores.shape[1]:
        raise ValueError(
            f"passage_doc_ids shape {tuple(passage_doc_ids.shape)} does not match the {scores.shape[1]} score columns"
        )
    if passage_doc_ids.is_floating_point() or passage_doc_ids.is_complex() or passage_doc_ids.dtype == torch.bool:
        raise ValueError(f"passage_doc_ids must be an integer tensor, got dtype {passage_doc_ids.dtype}")
    if train_n_passages < 1 or local_batch_size < 0 or rank < 0:
        raise ValueError(
            f"train_n_passages {train_n_passages} must be >= 1, local_batch_size {local_batch_size} and "
            f"rank {rank} >= 0"
        )
    if scores.shape[0] != local_batch_size:
        raise ValueError(f"scores has {scores.shape[0]} rows, expected local_batch_size {local_batch_size}")
    last_positive = ((rank + 1) * local_batch_size - 1) * train_n_passages
    if local_batch_size and last_positive >= scores.shape[1]:
        raise ValueError(
            f"rank {rank} with local_batch_size {local_batch_size} and train_n_passages {train_n_passages} "
            f"puts a positive at column {last_positive}, but scores has {scores.shape[1]} columns"
        )


def mask_gathered_passages_same_doc_as_positive(
    scores: torch.Tensor, passage_doc_ids: torch.Tensor, train_n_passages: int, rank: int, local_batch_size: int
) -> None:
    """In place: local query row i is global query g = rank·local_batch_size + i, its positive column
    p = g·train_n_passages; every other column whose doc id equals the positive's gets finfo(dtype).min."""
    _check_mask_args(scores, passage_doc_ids, train_n_passages, rank, local_batch_size)
    doc_ids = passage_doc_ids.to(scores.device)
    rows = torch.arange(local_batch_size, device=scores.device)
    positives = (rank * local_batch_size + rows) * train_n_passages
    same_doc = doc_ids[positives][:, None] == doc_ids[None, :]  # [local_batch_size, B_global·n]
    same_doc[rows, positives] = False  # the true positive stays
    scores.masked_fill_(same_doc, torch.finfo(scores.dtype).min)
