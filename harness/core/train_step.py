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
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.nn.utils import parametrize

from shardcheck.harness.core.layout import Tensors
from shardcheck.harness.core.rank_context import RankContext
from shardcheck.harness.core.wrapped_names import OriginalNames, gathered

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
OptimizerFn = Callable[[list[nn.Parameter], float, RankContext | None], torch.optim.Optimizer]


class StepFields(Protocol):
    """What the step reads of its case: the fields of a ModelCase (shardcheck.harness.core.model_case) that say how
    it is run (named here, not imported: the model case imports this module)."""

    make_inputs: Callable[[torch.Generator], Tensors]
    model_inputs: tuple[str, ...]
    batch: str | None
    loss: Callable[[Any, Tensors, RankContext | None], torch.Tensor] | None
    step_context: Callable[[RankContext | None], contextlib.AbstractContextManager] | None
    optimizer: str | OptimizerFn
    lr: float
    microbatches: int
    steps: int
    clip_grad_norm: float | None
    clip_grad: ClipFn | None
    mixed_precision: MixedPrecisionPolicy | None
    skip_reason: str | None


def clip_grad_norm(params: list[nn.Parameter], max_norm: float, ctx: RankContext | None) -> torch.Tensor:
    """torch's clipping by the global norm (the default of `ModelCase.clip_grad`): DTensor gradients are reduced
    over their meshes by DTensor itself.  Returns the total norm."""
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def step_fields_error(case: StepFields) -> str | None:
    """What is wrong with the step's fields as declared (one line naming the field), or None: checked when the case
    is made, before any run."""
    if not callable(case.optimizer) and case.optimizer not in ("sgd", "adamw"):
        return f"optimizer {case.optimizer!r}; expected 'sgd', 'adamw' or a callable"
    for name in ("microbatches", "steps"):
        if not isinstance(getattr(case, name), int) or getattr(case, name) < 1:
            return f"{name} {getattr(case, name)!r}; expected a positive int"
    if case.clip_grad_norm is not None and not case.clip_grad_norm > 0:
        return f"clip_grad_norm {case.clip_grad_norm!r}; expected a positive number"
    if case.microbatches == 1 or case.skip_reason is not None:
        return None
    try:
        data = case.make_inputs(torch.Generator().manual_seed(0))
    except Exception:  # the ranks report it (a reference error row), as without micro-batches
        return None
    name = case.batch or case.model_inputs[0]
    rows = batch_rows(data, name)
    if rows is None:
        return f"microbatches {case.microbatches}: the batch input {name!r} is not an input with a dim 0 to split"
    if rows % case.microbatches:
        return f"microbatches {case.microbatches} does not divide the batch ({name!r} has {rows} rows)"
    return None


def batch_rows(data: Tensors, name: str) -> int | None:
    """The batch's rows: dim 0 of input `name` (None where it has none)."""
    return int(data[name].shape[0]) if name in data and data[name].dim() else None


def microbatches(case: StepFields, data: Tensors, full_shapes: dict[str, tuple[int, ...]]) -> list[Tensors]:
    """The step's micro-batches of `data` (the full inputs, or this rank's pieces): micro-batch j takes rows j,
    j + k, j + 2k, ... of every input with as many rows (dim 0) as the batch (by their full shapes).  So a rank's
    piece of a batch split evenly over dp (each piece a multiple of k rows) gives, split so, its piece of each
    micro-batch of the whole batch."""
    k = case.microbatches
    if k == 1:
        return [data]
    rows = full_shapes[case.batch or case.model_inputs[0]][0]
    split = {n for n, shape in full_shapes.items() if n in data and shape and shape[0] == rows}
    return [{n: v[j::k] if n in split else v for n, v in data.items()} for j in range(k)]


def run_step(
    case: StepFields,
    model: nn.Module,
    batches: list[Tensors],
    ctx: RankContext | None,
    arrive: Callable[[Made], None],
) -> None:
    """`case.steps` optimizer steps of `model`, each over the micro-batches `batches`, each tensor handed to `arrive`
    as it is made, in execution order.  Detached, not copied: `arrive` copies what it keeps."""
    names = OriginalNames(model)  # a wrapped model's names as build() gave them
    params = names.parameters(model)
    optimizer = make_optimizer(case, [p for _, p in params], ctx)
    around = case.step_context(ctx) if case.step_context is not None else contextlib.nullcontext()
    with around:  # the whole step: forwards, losses, backwards, clipping and the optimizer steps
        for step in range(case.steps):
            for mb, data in enumerate(batches):
                _forward_backward(
                    case, model, data, ctx, lambda m, mb=mb, step=step: arrive(_at(m, step, mb)), step, names=names
                )
            # A DTensor gradient left Partial (a replicated norm weight under sequence parallelism) is the sum of the
            # ranks' pieces, as DTensor defines it: compared so, while the step shows whether the optimizer reduced it.
            # FSDP1's flat pieces are judged whole (gathered).
            with gathered(model, with_grads=True):
                for name, p in names.parameters(model):
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
            with gathered(model):
                for name, p in names.parameters(model):
                    arrive(Made(Kind.STEP, name, p.detach(), step))
            optimizer.zero_grad(set_to_none=True)


def _at(made: Made, step: int, microbatch: int) -> Made:
    return Made(made.kind, made.key, made.tensor, step, microbatch)


def _forward_backward(
    case: StepFields,
    model: nn.Module,
    data: Tensors,
    ctx: RankContext | None,
    arrive: Callable[[Made], None],
    step: int,
    *,
    names: OriginalNames,
) -> None:
    """One micro-batch's forward, loss and backward; the hooks (on the modules build() made, under their names)
    hand over module outputs and the gradients at them in the first optimizer step only."""
    hooks = _ModuleHooks(arrive)
    # under torch.compile the hooks run as Python, not traced (judging inside them is no part of the model)
    opaque = torch.compiler.disable if names.compiled else (lambda hook: hook)
    modules = names.modules(model) if not step else []
    handles = [m.register_forward_hook(opaque(hooks.on_forward(path))) for path, m in modules]
    try:
        with torch.enable_grad(), _low_precision(case, model, ctx):
            out = _forward(case, model, [data[n] for n in case.model_inputs], ctx)
            loss = case.loss(out, data, ctx) if case.loss is not None else out
            if isinstance(loss, DTensor):
                loss = loss.full_tensor()
            arrive(Made(Kind.LOSS, Kind.LOSS.value, loss.detach()))
            hooks.backward = True  # a forward hook firing from here on is an activation checkpoint's recomputation
            loss.backward()
    finally:
        for h in handles:
            h.remove()


def _forward(case: StepFields, model: nn.Module, args: list, ctx: RankContext | None):
    """The model's call; under a mixed-precision policy emulated (`_low_precision`), its floating inputs cast to
    `param_dtype` (`cast_forward_inputs`) and its output to `output_dtype`."""
    policy = _emulated_policy(case, model, ctx)
    if policy is None:
        return model(*args)
    if policy.cast_forward_inputs:
        args = [a.to(policy.param_dtype) if torch.is_floating_point(a) else a for a in args]
    out = model(*args)
    return out.to(policy.output_dtype) if policy.output_dtype is not None and torch.is_tensor(out) else out


def _emulated_policy(case: StepFields, model: nn.Module, ctx: RankContext | None):
    """The mixed-precision policy the single-device step emulates: the case's, below float64 (whose run is the
    exact answer); None on the ranks (the plan applies it) and without one."""
    policy = case.mixed_precision
    if ctx is not None or policy is None or policy.param_dtype is None:
        return None
    return None if all(p.dtype == torch.float64 for p in model.parameters()) else policy


class _Cast(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)


@contextlib.contextmanager
def _low_precision(case: StepFields, model: nn.Module, ctx: RankContext | None):
    """FSDP2's `MixedPrecisionPolicy` on one device, for one forward and its backward: every parameter read as its
    cast to `param_dtype` (a parametrization, so an activation checkpoint's recomputation reads it so too, and each
    gradient returns to its master parameter in the master's dtype, as FSDP2's fp32 `reduce_dtype` gives it).  Not
    emulated: a `reduce_dtype` below the master's (the ranks' reduction rounds in it; one device reduces nothing)."""
    policy = _emulated_policy(case, model, ctx)
    owned = [(m, n) for m in model.modules() for n, _ in m.named_parameters(recurse=False)] if policy else []
    for module, name in owned:
        parametrize.register_parametrization(module, name, _Cast(policy.param_dtype), unsafe=True)
    try:
        yield
    finally:
        for module, name in owned:  # the same Parameter objects back (the optimizer's)
            parametrize.remove_parametrizations(module, name, leave_parametrized=False)


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


def make_optimizer(case: StepFields, params: list[nn.Parameter], ctx: RankContext | None) -> torch.optim.Optimizer:
    """The case's optimizer over `params`: torch's SGD or AdamW at `case.lr`, or the plan's own
    (`optimizer(params, lr, ctx)`, ctx None on the single device, where it makes the reference's).

    SGD and AdamW step one parameter at a time (`foreach=False`, CPU's default): on a GPU torch's default batches
    them into foreach kernels, which raise on a list mixing DTensor and plain parameters (a TP plan that leaves its
    norms unsharded has one; seen on an H200)."""
    if callable(case.optimizer):
        return case.optimizer(params, case.lr, ctx)
    optimizer = torch.optim.SGD if case.optimizer == "sgd" else torch.optim.AdamW
    return optimizer(params, lr=case.lr, foreach=False)


def first_float(out) -> torch.Tensor | None:
    """A module's compared output: the tensor, or the first floating tensor of a tuple/list."""
    if isinstance(out, torch.Tensor):
        return out if out.is_floating_point() else None
    if isinstance(out, (tuple, list)):
        return next((t for t in out if isinstance(t, torch.Tensor) and t.is_floating_point()), None)
    return None
