"""The training step a model case runs, with hooks: every tensor it makes handed over as it is made.

Both sides of a model case run this same step: the single-device model (ctx None) and each rank's parallelized one.
It knows nothing of layouts or check names (shardcheck.harness.core.model_case names and lays out what it hands
over).  One step is `steps` optimizer steps on the same micro-batches; each of them is, for every micro-batch, a
forward (hooks on every submodule: its output, and a tensor hook for the gradient arriving at it), the loss and the
backward, gradients accumulating; then every parameter's gradient, the gradient clipping (its total norm), the
optimizer step, every parameter's optimizer state and every parameter after it.  Module outputs and the gradients at
them are handed over in the first optimizer step only (a later step's forward is a function of the parameters
already compared after the step before, on the same inputs: a divergence in it shows at that step's loss).
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
    DPARAM = "dparam"  # a parameter's gradient, accumulated over the micro-batches, before clipping
    GRAD_NORM = "grad_norm"  # the total norm the clipping computed
    STATE = "state"  # a parameter's optimizer state after the step (key "<param>.<state>": exp_avg, step, ...)
    STEP = "step"  # a parameter after the optimizer step


@dataclass(frozen=True)
class Made:
    """One tensor of the step as it is made: its kind, its key (the module path, "#k" for its k-th call after the
    first; the parameter name; "<param>.<state>"; the kind for the loss and the norm), the tensor (detached, not
    copied: a DTensor as it is), and where: the optimizer step and the micro-batch (from 0)."""

    kind: Kind
    key: str
    tensor: torch.Tensor
    step: int = 0
    microbatch: int = 0


ClipFn = Callable[[list[nn.Parameter], float, RankContext | None], torch.Tensor]


def clip_grad_norm(params: list[nn.Parameter], max_norm: float, ctx: RankContext | None) -> torch.Tensor:
    """torch's clipping by the global norm (the default of `ModelCase.clip_grad`): DTensor gradients are reduced
    over their meshes by DTensor itself.  Returns the total norm."""
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def run_step(
    case: ModelCase,
    model: nn.Module,
    batches: list[Tensors],
    ctx: RankContext | None,
    arrive: Callable[[Made], None],
) -> None:
    """`case.steps` optimizer steps of `model`, each over the micro-batches `batches`, each tensor handed to `arrive`
    as it is made, in execution order.  Detached, not copied: `arrive` copies what it keeps."""
    params = list(model.named_parameters())
    optimizer = make_optimizer(case, [p for _, p in params], ctx)
    around = case.step_context(ctx) if case.step_context is not None else contextlib.nullcontext()
    with around:
        for step in range(case.steps):
            for mb, data in enumerate(batches):
                _forward_backward(case, model, data, ctx, lambda m, mb=mb, step=step: arrive(_at(m, step, mb)), step)
            # A DTensor gradient left Partial (a replicated norm weight under sequence parallelism) is the sum of the
            # ranks' pieces, as DTensor defines it: compared so, while the step shows whether the optimizer reduced it.
            for name, p in params:
                if p.grad is not None:
                    arrive(Made(Kind.DPARAM, name, p.grad.detach(), step))
            if case.clip_grad_norm is not None:
                norm = (case.clip_grad or clip_grad_norm)([p for _, p in params], case.clip_grad_norm, ctx)
                norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
                arrive(Made(Kind.GRAD_NORM, Kind.GRAD_NORM.value, norm.detach(), step))
            optimizer.step()
            for name, p in params:
                for state, value in optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        arrive(Made(Kind.STATE, f"{name}.{state}", value.detach(), step))
            for name, p in params:
                arrive(Made(Kind.STEP, name, p.detach(), step))
            optimizer.zero_grad(set_to_none=True)


def _at(made: Made, step: int, microbatch: int) -> Made:
    return Made(made.kind, made.key, made.tensor, step, microbatch)


def _forward_backward(
    case: ModelCase,
    model: nn.Module,
    data: Tensors,
    ctx: RankContext | None,
    arrive: Callable[[Made], None],
    step: int,
) -> None:
    """One micro-batch's forward, loss and backward; the hooks hand over module outputs and the gradients at them in
    the first optimizer step only."""
    hooks = _ModuleHooks(arrive)
    handles = [m.register_forward_hook(hooks.on_forward(path)) for path, m in model.named_modules()] if not step else []
    try:
        with torch.enable_grad():
            out = model(*[data[n] for n in case.model_inputs])
            loss = case.loss(out, data, ctx) if case.loss is not None else out
            if isinstance(loss, DTensor):
                loss = loss.full_tensor()
            arrive(Made(Kind.LOSS, Kind.LOSS.value, loss.detach()))
            hooks.backward = True  # a forward hook firing from here on is an activation checkpoint's recomputation
            loss.backward()
    finally:
        for h in handles:
            h.remove()


class _ModuleHooks:
    """Forward hooks on every submodule for one forward and its backward.  Calls are counted per path in each phase,
    so that a module called twice is `<path>#1` in both; under activation checkpointing a module's forward runs
    again in the backward: its output was handed over in the forward and is not again, and the gradient at it is
    taken from the recomputed output only where the forward's output had no gradient (reentrant checkpointing runs
    the first forward without autograd)."""

    def __init__(self, arrive: Callable[[Made], None]) -> None:
        self.arrive = arrive
        self.backward = False
        self.calls: dict[tuple[bool, str], int] = {}
        self.with_gradient: set[str] = set()

    def on_forward(self, path: str):
        def hook(module, args, out):
            tensor = first_float(out)
            if tensor is None:
                return
            k = self.calls.get((self.backward, path), 0)
            self.calls[(self.backward, path)] = k + 1
            key = (path or ROOT_NAME) + (f"#{k}" if k else "")
            if not self.backward:
                self.arrive(Made(Kind.ACT, key, tensor.detach()))
            if tensor.requires_grad and key not in self.with_gradient:
                self.with_gradient.add(key)
                tensor.register_hook(lambda g: self.arrive(Made(Kind.DACT, key, g.detach())))

        return hook


OptimizerFn = Callable[[list[nn.Parameter], float, RankContext | None], torch.optim.Optimizer]


def make_optimizer(case: ModelCase, params: list[nn.Parameter], ctx: RankContext | None) -> torch.optim.Optimizer:
    """The case's optimizer over `params`: torch's SGD or AdamW at `case.lr`, or the plan's own
    (`optimizer(params, lr, ctx)`, ctx None on the single device, where it makes the reference's)."""
    if callable(case.optimizer):
        return case.optimizer(params, case.lr, ctx)
    optimizer = torch.optim.SGD if case.optimizer == "sgd" else torch.optim.AdamW
    return optimizer(params, lr=case.lr)


def first_float(out) -> torch.Tensor | None:
    """A module's compared output: the tensor, or the first floating tensor of a tuple/list."""
    if isinstance(out, torch.Tensor):
        return out if out.is_floating_point() else None
    if isinstance(out, (tuple, list)):
        return next((t for t in out if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
    return None
