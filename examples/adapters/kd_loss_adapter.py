"""The seed API of `kd_loss` over `legacy_kd_loss`: the module `--impl kd_loss=...` puts under test.

shardcheck compares every selected op's signature with the seed's and calls ops with the seed's
parameter names, so an adapter spells the seed's names and maps them onto the older API:
- `KDLoss(ignore_index, temperature, fp32_upcast, tp_group, chunk_size)` as the seed orders them;
  `tp_group` is kept here and handed to each call as the older `process_group`;
- `forward(student_logits, teacher_logits, labels, num_batch_labels)`: `num_batch_labels` is the
  older `num_valid_tokens`;
- what the older API lacks: vocab-sharded DTensor logits (the seed infers their TP group), given
  to the older loss as their local shard and that group; `_infer_tp_group_from_dtensor` is a seed
  name too, so it is defined here.
Everything else of the seed's module that the older one already spells the seed's way would be
re-exported unchanged (`from legacy_module import name`); here there is nothing else.

The older module is imported like any installed package; in this example it lives beside this file
(a module under test given as a file path can import the modules beside it).
"""

from __future__ import annotations

from typing import Optional, Union

import legacy_kd_loss as legacy
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


def _infer_tp_group_from_dtensor(logits: torch.Tensor) -> Optional[dist.ProcessGroup]:
    """The group of the mesh dim that shards a DTensor's last (vocab) dim; None for a plain tensor,
    another placement, or a vocab sharded over several mesh dims."""
    if not isinstance(logits, DTensor):
        return None
    last = logits.ndim - 1
    dims = [i for i, p in enumerate(logits.placements) if isinstance(p, Shard) and p.dim % logits.ndim == last]
    return logits.device_mesh.get_group(dims[0]) if len(dims) == 1 else None


def _plain(logits: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """The tensor the older loss expects: the local vocab shard with a group, else the full logits."""
    if not isinstance(logits, DTensor):
        return logits
    return logits.to_local() if group is not None else logits.full_tensor()


class KDLoss(torch.nn.Module):
    """The seed's KDLoss, computed by the older `legacy_kd_loss.KDLoss`."""

    def __init__(
        self,
        ignore_index: int = -100,
        temperature: float = 1.0,
        fp32_upcast: bool = True,
        tp_group: Optional[dist.ProcessGroup] = None,
        chunk_size: int = 0,
    ):
        super().__init__()
        self.tp_group = tp_group
        self.legacy = legacy.KDLoss(
            temperature=temperature, ignore_index=ignore_index, fp32_upcast=fp32_upcast, chunk_size=chunk_size
        )

    def forward(
        self,
        student_logits: torch.Tensor,
        teacher_logits: torch.Tensor,
        labels: torch.Tensor,
        num_batch_labels: Optional[Union[int, torch.Tensor]] = None,
    ) -> torch.Tensor:
        group = self.tp_group
        if group is None:
            group = _infer_tp_group_from_dtensor(student_logits)
        if group is None:
            group = _infer_tp_group_from_dtensor(teacher_logits)
        if isinstance(labels, DTensor):
            labels = labels.full_tensor()
        return self.legacy(
            _plain(student_logits, group),
            _plain(teacher_logits, group),
            labels,
            num_valid_tokens=num_batch_labels,
            process_group=group,
        )
