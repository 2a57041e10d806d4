"""BROKEN: gradient clipping by a norm computed from each rank's own shards only (the gradients' local pieces, never
reduced over the mesh): each rank scales its pieces by its own factor, and the total norm it reports is its pieces'."""

from __future__ import annotations

import torch
from _step_plan import loss, optimizer, parallelize  # noqa: F401 (the plan's other functions, unchanged)
from torch import nn
from torch.distributed.tensor import DTensor


def clip_grad(params: list[nn.Parameter], max_norm: float, ctx) -> torch.Tensor:
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(scale.item())
    return total
