"""CUDA-only tensor calls on a CPU machine: `.cuda()` and pinned memory leave the tensor on the CPU.

Code written for a GPU moves small index tensors with `torch.tensor(..., pin_memory=True).cuda(non_blocking=True)`
(NeMo-RL's `AllGatherCPTensor.backward` picks its CP chunks so).  On a machine without CUDA both raise, the
backward stops there, and what it computes before and after is never judged: a gradient zeroed just before that
line looks like the fixed version's crash.  Where the device is CPU and torch has no CUDA, `install()` makes
`Tensor.cuda()` and `Tensor.pin_memory()` return the tensor itself (it is already on the run's device) and drops
`pin_memory=True` from the factories that take it; every other argument, and every call on a CUDA machine, is left
as it is.  The calls it handled are counted (`CALLS`).
"""

from __future__ import annotations

import functools

import torch

NAME = "CUDA-only tensor calls (.cuda(), pin_memory=True) kept on the CPU"
CALLS = 0  # .cuda(), .pin_memory() and pin_memory=True factory calls handled in this process
FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange")


def wanted() -> bool:
    return not torch.cuda.is_available()


def _count() -> None:
    global CALLS
    CALLS += 1


def _stays(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    _count()
    return self


def _unpinned(factory):
    @functools.wraps(factory)
    def call(*args, **kwargs):
        if kwargs.get("pin_memory"):
            _count()
            kwargs["pin_memory"] = False
        return factory(*args, **kwargs)

    return call


def install() -> None:
    if getattr(torch.Tensor.cuda, "__shardcheck_shim__", False):
        return
    _stays.__shardcheck_shim__ = True
    torch.Tensor.cuda = _stays
    torch.Tensor.pin_memory = _stays
    for name in FACTORIES:
        setattr(torch, name, _unpinned(getattr(torch, name)))
