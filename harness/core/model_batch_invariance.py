"""Batch invariance of a model case, declared `ModelCase(batch_invariance=BatchInvariance())`: each sample's result
in the parallelized model must not depend on its position in the batch or on the other samples (NeMo-RL#1227), the
property harness/core/batch_invariance.py checks for an op case's output rows.

After the step, on each rank, the parallelized model is made again (the same plan, the same full weights) and run
forward, without gradients, on the rank's piece of the batch as it is, permuted (every sample moved) and split in two
halves; every module's output (its first floating tensor, a DTensor's local piece, as the step compares it) must give
each sample's row bit for bit the same (`atol` > 0 relaxes it).  A failure names the first module in forward order
whose rows change and the sample (its global index in the batch).  A module whose output does not follow the batch on
dim 0 (its rows do not halve with the batch: a [S, B, H] layout) is not compared; the loss, one number for the whole
batch, is not a per-sample result.  Each rank runs the same forwards on its own piece, so the plan's collectives stay
in step; the reruns run in the case's `step_context`, as the step does."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shardcheck.harness.core.batch_invariance import NAME
from shardcheck.harness.core.case import PropertiesFn, Property
from shardcheck.harness.core.layout import REPLICATED, Tensors
from shardcheck.harness.core.rank_context import RankContext
from shardcheck.harness.core.topology import MESH_DIMS
from shardcheck.harness.core.train_step import ROOT_NAME, first_float
from shardcheck.harness.core.wrapped_names import OriginalNames


@dataclass(frozen=True)
class BatchInvariance:
    """A model case's declaration that its samples are independent of the batch (`ModelCase.batch_invariance`).

    `inputs`: the inputs whose dim 0 is the batch, permuted and split together (None: every input with as many rows
    as the batch input, as micro-batches split them); `atol`: the largest change of a sample's row allowed (0: bit for
    bit, what the property means; a BLAS whose blocking follows the row count may need more)."""

    inputs: tuple[str, ...] | None = None
    atol: float = 0.0


class _Model(Protocol):
    """What the check reads of its ModelCase (named here: the model case imports this module)."""

    model_inputs: tuple[str, ...]
    batch: str | None
    step_context: Callable[[RankContext | None], contextlib.AbstractContextManager] | None

    def parallel_model(self, ctx: RankContext, local: Tensors) -> nn.Module: ...


def _batch_names(case: _Model, spec: BatchInvariance, ctx: RankContext, local: Tensors) -> tuple[str, tuple[str, ...]]:
    """(the batch input, the inputs permuted and split with it)."""
    batch = case.batch or case.model_inputs[0]
    if spec.inputs is not None:
        return batch, tuple(spec.inputs)
    rows = ctx.full_shapes[batch][0]
    return batch, tuple(n for n in local if n in ctx.full_shapes and ctx.full_shapes[n][:1] == (rows,))


def _declaration_error(case: _Model, names: tuple[str, ...], local: Tensors) -> str:
    """Why the declaration permutes nothing the model reads ("" when it does): a check that could not fail."""
    unknown = [n for n in names if n not in local]
    if unknown:
        return f"BatchInvariance inputs {unknown} are not inputs of the case (it has {sorted(local)})"
    if not any(n in names for n in case.model_inputs):
        return f"BatchInvariance permutes {list(names)}, none of the model's inputs {list(case.model_inputs)}"
    return ""


def _fewest_rows(ctx: RankContext, n: int) -> int:
    """The fewest batch rows any rank of the mesh holds (each rank must take the same decision: the reruns are
    collectives)."""
    fewest = torch.tensor([n], dtype=torch.int64)
    for dim in MESH_DIMS:
        if ctx.size(dim) > 1:
            dist.all_reduce(fewest, op=dist.ReduceOp.MIN, group=ctx.group(dim))
    return int(fewest)


def _module_outputs(model: nn.Module, call: Callable[[], object]) -> dict[str, torch.Tensor]:
    """{module key: its output's local piece} of one forward of `model` (`call`), keys as the step names them."""
    names = OriginalNames(model)
    got: dict[str, torch.Tensor] = {}
    calls: dict[str, int] = {}

    def on_forward(path: str):
        def hook(module, args, out):
            t = first_float(out)
            if t is None:
                return
            k = calls[path] = calls.get(path, -1) + 1
            t = t.to_local() if isinstance(t, DTensor) else t
            got[(path or ROOT_NAME) + (f"#{k}" if k else "")] = t.detach().double().clone()

        return hook

    opaque = torch.compiler.disable if names.compiled else (lambda hook: hook)
    handles = [m.register_forward_hook(opaque(on_forward(p))) for p, m in names.modules(model)]
    try:
        with torch.no_grad():
            call()
    finally:
        for h in handles:
            h.remove()
    return got


def _row_changes(want: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """Per row (dim 0), the largest change of `got` from `want`."""
    return (got - want).abs().reshape(want.shape[0], -1).amax(1)


def _verdict(how: str, changes: dict[str, torch.Tensor], samples: torch.Tensor, spec: BatchInvariance) -> Property:
    """One `batch_invariant:<how>` row: `changes` per compared module (forward order), each row's change."""
    bad = {key: rows for key, rows in changes.items() if bool((rows > spec.atol).any())}
    if not bad:
        return Property(f"{NAME}:{how}", True, value=0.0, message=f"{len(changes)} modules' outputs per sample")
    key, rows = next(iter(bad.items()))
    row = int(torch.nonzero(rows > spec.atol)[0])
    worst = max(float(r.max()) for r in bad.values())
    return Property(
        f"{NAME}:{how}",
        False,
        value=worst,
        message=f"module {key}: sample {int(samples[row])} (this rank's row {row}) changes by {float(rows[row]):.3g} "
        f"when the batch is {how}; {int((rows > spec.atol).sum())} of this rank's {len(rows)} samples there, "
        f"{len(bad)} of {len(changes)} modules ({'bit for bit' if spec.atol == 0 else f'atol {spec.atol:g}'})",
    )


def _compare(want: dict, permuted: dict, halves: list[dict], back: torch.Tensor) -> tuple[dict, dict]:
    """Per module whose output follows the batch on dim 0: each row's change when permuted, and when split."""
    n = len(back)
    moved, split = {}, {}
    for key, out in want.items():
        pieces = [h.get(key) for h in halves]
        if out.dim() == 0 or out.shape[0] != n or key not in permuted or any(p is None for p in pieces):
            continue
        if sum(p.shape[0] for p in pieces) != n or pieces[0].shape[1:] != out.shape[1:]:
            continue  # dim 0 is not the batch (it did not halve with it)
        moved[key] = _row_changes(out, permuted[key].index_select(0, back))
        split[key] = _row_changes(out, torch.cat(pieces))
    return moved, split


def model_batch_invariance(case: _Model, spec: BatchInvariance) -> PropertiesFn:
    """The `Case.properties` of a model case that declares `spec`: `batch_invariant:permuted` and
    `batch_invariant:split`, each naming the first module whose per-sample output changes, and the sample."""

    def check(ctx: RankContext, full: Tensors, local: Tensors, outs: tuple) -> list[Property]:
        batch, names = _batch_names(case, spec, ctx, local)
        wrong = _declaration_error(case, names, local)
        if wrong:
            return [Property(f"{NAME}:permuted", False, message=wrong)]
        n = int(local[batch].shape[0])
        if _fewest_rows(ctx, n) < 2:
            return [Property(f"{NAME}:permuted", True, message="one sample on a rank: nothing to move")]
        model = case.parallel_model(ctx, local)
        args = [local[k] for k in case.model_inputs]
        where = [i for i, k in enumerate(case.model_inputs) if k in names]

        def forward(index: torch.Tensor) -> dict[str, torch.Tensor]:
            picked = [a.index_select(0, index.to(a.device)) if i in where else a for i, a in enumerate(args)]
            return _module_outputs(model, lambda: model(*picked))

        order = torch.arange(n).roll(1).flip(0)  # every sample moves (n >= 2)
        around = case.step_context(ctx) if case.step_context is not None else contextlib.nullcontext()
        with around:
            want = forward(torch.arange(n))
            permuted = forward(order)
            halves = [forward(half) for half in torch.arange(n).tensor_split(2)]
        moved, split = _compare(want, permuted, halves, torch.argsort(order))
        if not moved:
            message = "no module's output has the batch's samples on dim 0: nothing to compare"
            return [Property(f"{NAME}:permuted", False, message=message)]
        layout = ctx.input_layouts.get(batch, REPLICATED)
        samples = layout.mesh_indices(ctx.full_shapes[batch], ctx.mesh, ctx.full_inputs)[0]
        return [_verdict("permuted", moved, samples, spec), _verdict("split", split, samples, spec)]

    return check
