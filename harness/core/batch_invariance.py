"""Batch invariance, a property any op case can declare: a row's result must not depend on its position in the
batch or on the other rows (NeMo-RL#1227: identical rows whose TP bf16 log-probs differ with their place in the
micro-batch).

`batch_invariance(run, inputs)` is a `Case.properties` function: on each rank it calls the case's `run` again on
its piece of the batch permuted (every row moved), and again on each half of it, and requires the rows of the
first output to come back bit for bit the ones the ordinary call gave (`atol` > 0 relaxes it).  A value check
cannot see this: each answer alone is within its budget, and only the same row computed twice disagrees.  The
re-runs call the op's collectives in the same order on every rank (each rank permutes and splits its own piece)."""

from __future__ import annotations

import torch

from shardcheck.harness.core.case import PropertiesFn, Property, RunFn, as_tuple
from shardcheck.harness.core.layout import Tensors
from shardcheck.harness.core.rank_context import RankContext

NAME = "batch_invariant"


def _rows(local: Tensors, names: tuple[str, ...], dim: int, index: torch.Tensor) -> Tensors:
    """The local inputs with the batch inputs' rows taken at `index` (the others as they are)."""
    return {k: v.index_select(dim, index.to(v.device)) if k in names else v for k, v in local.items()}


def _again(run: RunFn, ctx: RankContext, local: Tensors, index: torch.Tensor, *, names, dim: int, output: int):
    """The case's output `output` again, on the local batch's rows at `index` only."""
    with torch.no_grad():
        return as_tuple(run(ctx.impl, ctx, _rows(local, names, dim, index)))[output].detach()


def _verdict(how: str, want: torch.Tensor, got: torch.Tensor, dim: int, atol: float) -> Property:
    diff = (got.double() - want.double()).abs().movedim(dim, 0)
    diff = diff.reshape(diff.shape[0], -1).amax(1)  # per row
    bad = torch.nonzero(diff > atol).flatten()
    if len(bad) == 0:
        return Property(f"{NAME}:{how}", True, value=0.0)
    row = int(bad[0])
    return Property(
        f"{NAME}:{how}",
        False,
        value=float(diff.max()),
        message=f"{len(bad)} of this rank's {len(diff)} rows change when the batch is {how}: local row {row} by "
        f"{float(diff[row]):.3g} ({'bit for bit' if atol == 0 else f'atol {atol:g}'})",
    )


def batch_invariance(
    run: RunFn, inputs: tuple[str, ...], dim: int = 0, output: int = 0, atol: float = 0.0
) -> PropertiesFn:
    """A `Case.properties` function checking that the rows (dim `dim`) of output `output` do not depend on their
    position or on the other rows of `inputs` (the batch inputs, split on the same dim)."""

    def check(ctx: RankContext, full: Tensors, local: Tensors, outs: tuple) -> list[Property]:
        want = as_tuple(outs)[output].detach()
        n = want.shape[dim]
        if n < 2:
            return [Property(f"{NAME}:permuted", True, message="one row on this rank: nothing to move")]
        order = torch.arange(n).roll(1).flip(0)  # every row moves (n >= 2)
        where = {"names": inputs, "dim": dim, "output": output}
        permuted = _again(run, ctx, local, order, **where)
        back = permuted.index_select(dim, torch.argsort(order).to(permuted.device))
        halves = torch.arange(n).tensor_split(2)
        split = torch.cat([_again(run, ctx, local, half, **where) for half in halves], dim)
        return [_verdict("permuted", want, back, dim, atol), _verdict("split", want, split, dim, atol)]

    return check
