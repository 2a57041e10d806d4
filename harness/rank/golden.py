"""The golden of one item: full inputs in the item's dtype, the float64 reference's outputs and gradients, and the
reference run in the item's dtype (its budget).  The same on every rank."""

from __future__ import annotations

import torch

from shardcheck.harness.core.case import Case, as_tuple, is_float
from shardcheck.harness.core.compare import BudgetScope, budget, finite_max_abs
from shardcheck.harness.core.model_case import StepCase, check_kind
from shardcheck.harness.core.plan_data import DTYPES, Item
from shardcheck.reference import low_precision_math


def _detach(t):
    return t.detach() if isinstance(t, torch.Tensor) else t  # an output may legitimately be None


class Golden:
    """Full inputs in the item's dtype, the float64 golden outputs and gradients, and the
    reference run in the item's dtype (for the low-precision budget).  Same on every rank."""

    def __init__(self, case: Case, dtype: torch.dtype, seed: int, n_summands: int):
        gen = torch.Generator().manual_seed(seed)
        raw = case.make_inputs(gen)
        # Low-precision inputs are the float64 ones rounded; the golden sees the rounded values,
        # so input rounding is not counted as error.
        self.inputs = {k: v.to(dtype) if is_float(v) else v for k, v in raw.items()}
        self.upstream: list[torch.Tensor | None] = []
        self.case, self.n_summands = case, n_summands
        self._precision_runs: dict[str, tuple] = {}
        self._kind_scales: dict[object, float] = {}
        if case.bad_input is not None and case.bad_input.interpretation is None:  # no answer to compare against
            self.outputs = self.naive_outputs = ()
            self.grads = self.naive_grads = {}
            return
        self.outputs, self.grads = self._reference(
            case, {k: v.double() if is_float(v) else v for k, v in self.inputs.items()}, gen, n_summands
        )
        if dtype == torch.float64:
            self.naive_outputs, self.naive_grads = self.outputs, self.grads
        else:
            self.naive_outputs, self.naive_grads = self._reference(case, self.inputs, None, n_summands)

    def output_scale(self, index: int) -> float:
        """The scale of output `index`'s kind (compare.budget's floor): the largest finite golden magnitude among the
        outputs of its kind (an op's outputs are one kind; a model case's are its activations, the loss, the
        activations' gradients, the parameters' gradients and the parameters after the step)."""
        kinds = self._output_kinds()
        if kinds[index] not in self._kind_scales:
            mine = [finite_max_abs(o) for o, k in zip(self.outputs, kinds) if k == kinds[index]]
            self._kind_scales[kinds[index]] = max(mine, default=0.0)
        return self._kind_scales[kinds[index]]

    def grad_scale(self) -> float:
        """The scale of the inputs' gradients (one kind): their largest finite golden magnitude."""
        if "grad" not in self._kind_scales:
            self._kind_scales["grad"] = max(map(finite_max_abs, self.grads.values()), default=0.0)
        return self._kind_scales["grad"]

    def _output_kinds(self) -> list:
        if not isinstance(self.case, StepCase):
            return ["output"] * len(self.outputs)
        return [check_kind(check) for check in self.case.forward_checks]

    def precision_run(self, kind: str) -> tuple[tuple, dict]:
        """(outputs, grads) of the reference as code with a legitimate precision difference computes
        them: "float32" on the inputs rounded to float32 (for a float64 item), "bfloat16 math" in the
        item's dtype without the float32 upcast (shardcheck.reference.low_precision_math).  Only run when a check
        fails, once per item."""
        if kind not in self._precision_runs:
            self._precision_runs[kind] = self._precision(kind)
        return self._precision_runs[kind]

    def precision_limits(self, kind: str, dtype: torch.dtype) -> tuple[tuple, dict]:
        """(outputs, {}) as precision_run gives them, each output reduced to its tensor-wide budget in `dtype` (one
        number: BudgetScope.TENSOR) against that run: a model case's precision step needs no more, and the run (every
        module's tensors of the step) is not kept."""
        key = f"{kind} limits"
        if key not in self._precision_runs:
            outs = (self._precision_runs.get(kind) or self._precision(kind))[0]
            limits = []
            for i, (gold, alt) in enumerate(zip(self.outputs, outs)):
                both = gold is not None and alt is not None
                b = budget(gold, alt, dtype, BudgetScope.TENSOR, self.output_scale(i))[0] if both else None
                limits.append(None if b is None else float(b.reshape(-1)[0]) if b.numel() else 0.0)
            self._precision_runs[key] = (tuple(limits), {})
        return self._precision_runs[key]

    def _precision(self, kind: str) -> tuple[tuple, dict]:
        if kind == "float32":
            inputs = {k: v.float() if is_float(v) else v for k, v in self.inputs.items()}
            return self._reference(self.case, inputs, None, self.n_summands)
        with low_precision_math():
            return self._reference(self.case, self.inputs, None, self.n_summands)

    def _reference(self, case: Case, inputs: dict, gen, n_summands: int):
        inputs = {k: v.clone().requires_grad_(k in case.grad_inputs) for k, v in inputs.items()}
        with torch.enable_grad():
            outs = as_tuple(case.reference(inputs))
        if not case.grad_inputs:
            return tuple(_detach(o) for o in outs), {}
        if gen is not None:  # first (float64) pass draws the upstream gradients; never all ones
            for o in outs:
                if is_float(o) and o.requires_grad:
                    g = torch.randn((n_summands, *o.shape), generator=gen, dtype=torch.float64)
                    g[:, ~torch.isfinite(o.detach())] = 0.0  # no gradient flows from -inf/NaN outputs
                    self.upstream.append(g)
                else:
                    self.upstream.append(None)
        xs = [inputs[n] for n in case.grad_inputs]
        used = [(o, g) for o, g in zip(outs, self.upstream) if g is not None]
        # The golden backpropagates the summed upstream once.  A low-precision run backpropagates each
        # summand's upstream and adds the gradients in its dtype, as the ranks do (each rank's output is
        # its own summand): its error then includes the rounding of the summands, which can be larger
        # than their sum (CP ranks' gradients cancel), and the budget follows.
        summands = [None] if gen is not None else range(n_summands)
        total = [None] * len(xs)
        for s in summands:
            ups = [(g.sum(0) if s is None else g[s]).to(o.dtype) for o, g in used]
            grads = torch.autograd.grad([o for o, _ in used], xs, ups, allow_unused=True, retain_graph=s is not None)
            total = [g if t is None else (t if g is None else t + g) for t, g in zip(total, grads)]
        grads = {
            n: (g if g is not None else torch.zeros_like(x)).detach() for n, x, g in zip(case.grad_inputs, xs, total)
        }
        return tuple(_detach(o) for o in outs), grads


class GoldenCache:
    """The golden of the last case run: items come grouped by case and dtype, so one kept is enough."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.golden: Golden | None = None

    def get(self, case: Case, item: Item, n_summands: int) -> Golden:
        key = (case.op, case.case_id, item.dtype, item.seed, n_summands)
        if key != self.key:
            self.key, self.golden = key, Golden(case, DTYPES[item.dtype], item.seed, n_summands)
        return self.golden
