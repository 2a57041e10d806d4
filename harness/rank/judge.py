"""Judging one local tensor against its slice of the golden: tensors in, verdicts out; nothing here emits a row or
keeps a tensor (the item's run does both, harness/rank/item_run.py).

`measure` gives a tensor's verdict against the budget of the reference run in the item's dtype; `settle` is the
precision step after it: a failing check that a legitimate precision difference explains becomes `warn` (or passes,
where the family's contract allows it).  `settle` may run the reference again as such code computes it
(Golden.precision_run: once per item and kind, and only for a failing check).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardcheck.harness.core.compare import BudgetScope, budget, compare, judge
from shardcheck.harness.core.layout import Layout
from shardcheck.harness.core.records import Status, Symptom
from shardcheck.harness.rank.golden import Golden


@dataclass(frozen=True)
class Placement:
    """Where a local tensor sits in its full one: its layout over the mesh (index rules may read the full inputs)."""

    layout: Layout
    mesh: object
    inputs: dict[str, torch.Tensor]

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of `full`."""
        return self.layout.local(full, self.mesh, self.inputs)


@dataclass(frozen=True)
class Budget:
    """What a tensor's budget is measured from: the golden against a reference run in `dtype` (compare.budget)."""

    gold_full: torch.Tensor  # the golden's own tensor, not a copy
    ref_full: torch.Tensor
    dtype: torch.dtype
    scope: BudgetScope
    kind_scale: float  # the item's largest golden magnitude among tensors of this one's kind (Golden.output_scale)
    compute_dtype: torch.dtype | None = None  # the budget's dtype where the math ran below `dtype` (Case.compute_dtype)
    kept: dict | None = dataclasses.field(default=None, compare=False, repr=False)  # its golden's (Golden.budgets)
    input_scale: float = 0.0  # the largest magnitude of the inputs that made it (Golden.input_scale): an all-zero floor

    @property
    def budget_dtype(self) -> torch.dtype:
        """The item's dtype, or the compute dtype where it is the narrower (a bfloat16 item under a float32 compute
        dtype keeps bfloat16's budget)."""
        if self.compute_dtype is None or torch.finfo(self.compute_dtype).eps <= torch.finfo(self.dtype).eps:
            return self.dtype
        return self.compute_dtype

    def full(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """compare.budget of the whole tensor, worked out once per golden where `kept` is the golden's: every
        topology of a launch judges the same golden tensors (GoldenCache keeps the golden across them)."""
        args = (self.gold_full, self.ref_full, self.budget_dtype, self.scope, self.kind_scale)
        if self.kept is None:
            return budget(*args, self.input_scale)
        key = (id(self.gold_full), id(self.ref_full), *args[2:], self.input_scale)
        hit = self.kept.get(key)  # holds its tensors: their ids are not reused while it is kept
        if hit is None or hit[0] is not self.gold_full or hit[1] is not self.ref_full:
            hit = self.kept[key] = (self.gold_full, self.ref_full, budget(*args, self.input_scale))
        return hit[2]


@dataclass(frozen=True)
class Comparison:
    """One local tensor to judge: what the op gave (its partial sums reduced), its slice of the golden, its budget
    (against the reference run in the dtype the op should return) and where it sits."""

    check: str
    got: torch.Tensor
    expected: torch.Tensor
    budget: Budget
    place: Placement
    got_dtype: torch.dtype  # as the op returned it (before Layout.reduce_partial)


@dataclass(frozen=True)
class Verdict:
    """One local tensor judged: what its row needs, and what the precision step needs (the tensors themselves only
    where it compares them elementwise)."""

    check: str
    stats: dict
    status: Status
    ratio: float
    message: str
    symptom: Symptom | None
    got_dtype: torch.dtype
    budget: Budget  # its dtype: the dtype expected of the op
    place: Placement
    got: torch.Tensor | None
    expected: torch.Tensor | None

    def row_fields(self) -> dict:
        """The fields of its check row (beside check and status)."""
        stats = {k: v for k, v in self.stats.items() if k != "err_ratio"}
        return dict(
            err_ratio=self.ratio if self.ratio != float("inf") else None,
            message=self.message,
            symptom=self.symptom,
            keep_message=self.status == Status.PASS and bool(self.message),  # a precision the contract allows, cited
            **{"budget": None, "err_naive": None, **stats},
        )


@dataclass(frozen=True)
class PrecisionRun:
    """Where the precision step finds a tensor in the reference run as code with a legitimate precision difference
    computes it: `pick` takes it out of a Golden.precision_run's (outputs, grads)."""

    golden: Golden
    pick: Callable[[tuple], torch.Tensor]
    item_dtype: torch.dtype


def judge_tensor(got: torch.Tensor, expected: torch.Tensor, b: Budget, place: Placement) -> tuple:
    """(stats, status, err/budget, this rank's budgets) of a local tensor against its slice of the golden."""
    b_full, naive_err_full = b.full()
    limit = place.local(b_full)
    err_naive = place.local(naive_err_full) if naive_err_full is not None else None
    stats = compare(got, expected, limit, err_naive)
    status, ratio = judge(stats)
    return stats, status, ratio, limit


def judge_largest(max_abs_err: float, limit: float) -> tuple[str, float]:
    """(status, err/budget) of a tensor whose budget is one value throughout (BudgetScope.TENSOR), from its largest
    error alone: what compare() and judge() give on the tensor itself (an error where the budget is 0: inf)."""
    ratio = 0.0 if max_abs_err == 0 else (max_abs_err / limit if limit > 0 else math.inf)
    return (Status.PASS if ratio <= 1.0 else Status.FAIL), ratio


def measure(c: Comparison, arriving: bool = False) -> tuple[Verdict, torch.Tensor]:
    """(verdict before the precision step, this rank's budgets) of one local tensor.  `arriving`: judged as the run
    made it (a model case's step), so the verdict keeps the tensors only where the precision step compares them
    elementwise (a failing check with per-row budgets)."""
    stats, status, ratio, limit = judge_tensor(c.got, c.expected, c.budget, c.place)
    msg = ""
    symptom = (
        None
        if status == Status.PASS
        else Symptom.SHAPE
        if "shape_mismatch" in stats
        else Symptom.NONFINITE
        if stats.get("nonfinite")
        else Symptom.VALUES
    )
    expect_dtype = c.budget.dtype
    if c.got_dtype != expect_dtype:  # a wrong value in the wrong dtype is a wrong value (its line, its verdict)
        status, msg, symptom = (
            Status.FAIL,
            f"dtype {str(c.got_dtype)[6:]}, expected {str(expect_dtype)[6:]}",
            symptom or Symptom.DTYPE,
        )
    place = c.place
    for key in ("worst", "nonfinite"):
        if stats.get(key):
            stats[key]["global_index"] = list(
                place.layout.global_index(stats[key]["local_index"], c.budget.gold_full.shape, place.mesh, place.inputs)
            )
    # A tensor-wide budget is one number: the precision step then needs the largest error alone, not the tensors.
    elementwise = not arriving or (status == Status.FAIL and c.budget.scope != BudgetScope.TENSOR)
    verdict = Verdict(
        check=c.check,
        stats=stats,
        status=status,
        ratio=ratio,
        message=msg,
        symptom=symptom,
        got_dtype=c.got_dtype,
        budget=c.budget,
        place=place,
        got=c.got if elementwise else None,
        expected=c.expected if elementwise else None,
    )
    return verdict, limit


def settle(v: Verdict, precision: PrecisionRun | None) -> Verdict:
    """The verdict after the precision step: a failing check that a legitimate precision difference explains becomes
    `warn`, or passes where the family's contract allows that difference (Case.allows_float32)."""
    stats, status, msg, symptom = v.stats, v.status, v.message, v.symptom
    if status != Status.FAIL or precision is None or "shape_mismatch" in stats or stats.get("nonfinite"):
        return v
    finding, kind = precision_finding(v, precision)
    allowed = precision.golden.case.allows_float32 if kind == "float32" else None
    if finding and allowed:  # the family's documented precision: not a finding at all
        status, msg, symptom = Status.PASS, f"{finding}, which the contract allows ({allowed})", None
    elif finding:
        status, msg, symptom = Status.WARN, "; ".join(m for m in (finding, msg) if m), Symptom(f"precision:{kind}")
    return dataclasses.replace(v, status=status, message=msg, symptom=symptom)


def precision_finding(v: Verdict, precision: PrecisionRun) -> tuple[str, str]:
    """(words, "float32" | "bfloat16") of the precision difference that explains a failing check, or ("", ""):
    a float64 item within the float32 budget of the same item, a bfloat16 item within the budget of bfloat16
    math."""
    kind, low = {torch.float64: ("float32", torch.float32), torch.bfloat16: ("bfloat16 math", torch.bfloat16)}.get(
        precision.item_dtype, (None, None)
    )
    if kind is None or v.got_dtype not in (v.budget.dtype, low):
        return "", ""
    golden = precision.golden
    try:  # a tensor-wide budget (one value): the largest error against it is the largest ratio, as compare()'s
        alt = precision.pick(golden.precision_run(kind) if v.got is not None else golden.precision_limits(kind, low))
    except Exception:  # the reference cannot run that way: no excuse for the error
        return "", ""
    if v.got is not None:
        alt_budget = dataclasses.replace(v.budget, ref_full=alt, dtype=low)
        _, status, ratio, _ = judge_tensor(v.got, v.expected, alt_budget, v.place)
    else:
        status, ratio = judge_largest(v.stats["max_abs_err"], alt)
    if status != Status.PASS:
        return "", ""
    if kind == "float32":
        return f"float64 computed in float32 (err/budget {ratio:.2g} against the float32 budget)", "float32"
    return (
        f"bfloat16 math, docs/ops/README.md asks for float32 (err/budget {ratio:.2g} against bfloat16 math)",
        "bfloat16",
    )
