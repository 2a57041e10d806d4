"""The plan under test of the guide's parameter-gradient recipe: torch's tensor-parallel MLP."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def parallelize(mlp: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """`up` column-parallel (its output split over TP), `down` row-parallel (its partial sums all-reduced)."""
    return parallelize_module(mlp, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
