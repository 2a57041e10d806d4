"""The training step a model case runs, with hooks: every tensor it makes handed over as it is made.

Both sides of a model case run this same step: the single-device model (ctx None) and each rank's parallelized one.
It knows nothing of layouts or check names (shardcheck.harness.core.model_case names and lays out what it hands
over): forward hooks on every submodule (its output, and a tensor hook for the gradient arriving at it), the loss,
the backward, every parameter's gradient, the optimizer step and every parameter after it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardcheck.harness.core.layout import Tensors
from shardcheck.harness.core.rank_context import RankContext

if TYPE_CHECKING:
    from shardcheck.harness.core.model_case import ModelCase

ROOT_NAME = "model"  # the root module's key (its path is "")


class Kind(StrEnum):
    """What a tensor of the step is, in the order the step makes them."""

    ACT = "act"  # a submodule's output
    LOSS = "loss"
    DACT = "dact"  # the gradient arriving at a submodule's output
    DPARAM = "dparam"  # a parameter's gradient
    STEP = "step"  # a parameter after the optimizer step


@dataclass(frozen=True)
class Made:
    """One tensor of the step as it is made: its kind, its key (the module path, "#k" for its k-th call after the
    first; the parameter name; "loss") and the tensor (detached, not copied: a DTensor as it is)."""

    kind: Kind
    key: str
    tensor: torch.Tensor


def run_step(
    case: ModelCase,
    model: nn.Module,
    data: Tensors,
    ctx: RankContext | None,
    arrive: Callable[[Made], None],
) -> None:
    """One training step of `model` on `data`, each tensor handed to `arrive` as it is made, in execution order.
    Detached, not copied: `arrive` copies what it keeps."""
    calls: dict[str, int] = {}

    def on_forward(path: str):
        def hook(module, args, out):
            tensor = first_float(out)
            if tensor is None:
                return
            k = calls.get(path, 0)
            calls[path] = k + 1
            key = (path or ROOT_NAME) + (f"#{k}" if k else "")
            arrive(Made(Kind.ACT, key, tensor.detach()))
            if tensor.requires_grad:
                tensor.register_hook(lambda g, key=key: arrive(Made(Kind.DACT, key, g.detach())))

        return hook

    handles = [m.register_forward_hook(on_forward(path)) for path, m in model.named_modules()]
    around = case.step_context(ctx) if case.step_context is not None else contextlib.nullcontext()
    try:
        with around, torch.enable_grad():
            out = model(*[data[n] for n in case.model_inputs])
            loss = case.loss(out, data, ctx) if case.loss is not None else out
            if isinstance(loss, DTensor):
                loss = loss.full_tensor()
            arrive(Made(Kind.LOSS, "loss", loss.detach()))
            loss.backward()
    finally:
        for h in handles:
            h.remove()
    params = list(model.named_parameters())
    # A DTensor gradient left Partial (a replicated norm weight under sequence parallelism) is the sum of the
    # ranks' pieces, as DTensor defines it: compared so, while the step shows whether the optimizer reduced it.
    for name, p in params:
        if p.grad is not None:
            arrive(Made(Kind.DPARAM, name, p.grad.detach()))
    make_optimizer(case, [p for _, p in params]).step()
    for name, p in params:
        arrive(Made(Kind.STEP, name, p.detach()))


def make_optimizer(case: ModelCase, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    optimizer = torch.optim.SGD if case.optimizer == "sgd" else torch.optim.AdamW
    return optimizer(params, lr=case.lr)


def first_float(out) -> torch.Tensor | None:
    """A module's compared output: the tensor, or the first floating tensor of a tuple/list."""
    if isinstance(out, torch.Tensor):
        return out if out.is_floating_point() else None
    if isinstance(out, (tuple, list)):
        return next((t for t in out if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
    return None
