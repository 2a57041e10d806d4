"""Where a DTensor's local piece sits when no Layout of the (dp, cp, tp) mesh describes it: FSDP2's parameters and
gradients on the flattened dp x cp mesh, a TP shard sharded again over it (`_StridedShard`).  torch lays the golden
out as the DTensor is laid out, on this rank alone (`distribute_tensor(..., src_data_rank=None)` slices its own full
tensor and sends nothing), so a model case judges the piece where it is instead of gathering the whole tensor: a
collective per parameter and step, the costliest part of a module-by-module check on gloo (docs/performance.md)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor
from torch.distributed.tensor.placement_types import Placement


@dataclass(frozen=True)
class DTensorPiece:
    """A DTensor's own mesh and placements, read as a Layout is by the judging (harness/rank/judge.py `Placement`):
    the local piece of a full tensor, where a local element sits in it.  No Partial placement: a partial sum is not
    a piece of the golden (such a tensor is gathered whole, as before)."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]

    @staticmethod
    def of(t: DTensor) -> DTensorPiece | None:
        """The piece `t` is, or None where one of its placements is a partial sum."""
        if any(isinstance(p, Partial) for p in t.placements):
            return None
        return DTensorPiece(t.device_mesh, tuple(t.placements))

    def local(self, full: torch.Tensor, mesh: object = None, inputs: object = None) -> torch.Tensor:
        """This rank's piece of `full` (no communication; `mesh` and `inputs`: a Layout's, unused)."""
        return distribute_tensor(full.detach(), self.mesh, self.placements, src_data_rank=None).to_local()

    def reduce_partial(self, local: torch.Tensor, mesh: object = None) -> torch.Tensor:
        return local  # (no Partial placement: `of`)

    def mesh_indices(self, full_shape: Sequence[int], mesh: object = None, inputs: object = None) -> list[torch.Tensor]:
        """Per dim, the global indices of this rank's piece along it: a piece is a product of one index set per dim
        (as a Layout's is), so each is the piece of that dim's range under the placements that shard that dim alone
        (a check judges every tensor's worst element: this runs once per check, on a few short ranges)."""
        out = []
        for dim, size in enumerate(full_shape):
            along = torch.arange(size).view([size if d == dim else 1 for d in range(len(full_shape))])
            placements = [p if _sharded_dim(p, len(full_shape)) == dim else Replicate() for p in self.placements]
            out.append(distribute_tensor(along, self.mesh, placements, src_data_rank=None).to_local().reshape(-1))
        return out

    def global_index(
        self, local_index: Sequence[int], full_shape: Sequence[int], mesh: object = None, inputs: object = None
    ) -> tuple[int, ...]:
        idx = self.mesh_indices(full_shape)
        return tuple(int(ix[i]) for ix, i in zip(idx, local_index))


def _sharded_dim(placement: Placement, ndim: int) -> int | None:
    """The tensor dim a Shard or _StridedShard splits (None: a Replicate)."""
    dim = getattr(placement, "dim", None)
    return None if dim is None else dim % ndim
