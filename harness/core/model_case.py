"""A model under test: a parallelized module checked layer by layer against the single-device one.

`ModelCase(...).case()` is an ordinary `Case` (so topologies, dtypes, --impl, rerun lines, xfail, JUnit and the
report work unchanged) whose outputs are what one training step of the model produces, in execution order:

    act<NN>:<module>     every submodule's output, forward order (forward hooks)
    loss                 the loss
    dact<NN>:<module>    the gradient arriving at every submodule's output, backward order
    dparam:<param>       every parameter's gradient (each rank's shard against its slice of the full one)
    grad_norm            the gradients' total norm, where the step clips them
    state:<param>.<s>    every parameter's optimizer state after the step (AdamW's exp_avg, exp_avg_sq, step)
    step:<param>         every parameter after the optimizer step (SGD, AdamW, or the plan's optimizer)

each of micro-batch j >= 2 with `@mb<j>`, of optimizer step s >= 2 with `@step<s>` (harness/core/train_step.py runs
the step: micro-batches, clipping, several steps, mixed precision).

The full weights are inputs of the case (`param:<name>`, drawn by `build(gen)`): both models get the same ones, the
single-device one whole, the sharded one by each parameter's DTensor placements or, for a plain tensor, the
declared layout whose glob matches its name.  Layouts of the sharded tensors are read on the rank as the step runs
(DTensor placements; a plain activation's layout from its local shape, or a declared glob); the harness then
slices the golden and judges each check as any case's output.  shardcheck.harness.findings.model_order names the
first diverging module of a failing step.
"""

from __future__ import annotations

import contextlib
import fnmatch
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from shardcheck.harness.core.activation_layouts import gradient_over_batch, layout_by_shape
from shardcheck.harness.core.case import Case
from shardcheck.harness.core.compare import BudgetScope
from shardcheck.harness.core.dtensor_piece import DTensorPiece
from shardcheck.harness.core.known_failure import KnownFailure
from shardcheck.harness.core.layout import REPLICATED, Layout, Tensors
from shardcheck.harness.core.model_batch_invariance import BatchInvariance, model_batch_invariance
from shardcheck.harness.core.rank_context import RankContext
from shardcheck.harness.core.topology import EXPERT_DIMS, MESH_DIMS, Topology, mesh_dims
from shardcheck.harness.core.train_step import (
    ROOT_NAME,
    ClipFn,
    Kind,
    Made,
    OptimizerFn,
    batch_rows,
    microbatches,
    run_step,
    step_fields_error,
)
from shardcheck.harness.core.wrapped_names import OriginalNames, flat_parameters, gathered

PARAM_PREFIX = "param:"


# A model case's check names: its outputs' (`_name`), each `forward:<name>`, with `@step<s>` (optimizer step s from
# 2), `@mb<j>` (micro-batch j from 2) or `@step<s>.mb<j>` where the case runs several.
CHECK = re.compile(
    r"^forward:(?:(act|dact)(\d+):([^@]+)|(loss|grad_norm)|(dparam|state|step):([^@]+))"
    r"(?:@(?:step(\d+))?\.?(?:mb(\d+))?)?$"
)
_STAGE = {"act": 0, "loss": 1, "dact": 2, "dparam": 3, "grad_norm": 4, "state": 5, "step": 6}


def step_order(check: str) -> tuple[int, ...] | None:
    """The place of a model case's check in its step: (optimizer step, each micro-batch's forward / loss / backward
    before the gradients, clipping norm, optimizer state and stepped parameters, micro-batch, stage, index); None for
    any other check.  The first failing one in this order is the step's first divergence."""
    m = CHECK.match(str(check))
    if m is None:
        return None
    kind = m.group(1) or m.group(4) or m.group(5)
    step, mb = int(m.group(7) or 1), int(m.group(8) or 1)
    stage = _STAGE[kind]
    return step, int(stage > _STAGE["dact"]), mb, stage, int(m.group(2) or 0)


def check_kind(check: str) -> str:
    """A model check's kind of tensor, whose largest golden magnitude is the floor of its budget: the kinds of
    `_STAGE`, each optimizer state its own (`state:exp_avg_sq`: squared gradients, another scale)."""
    m = CHECK.match(str(check))
    kind = m.group(1) or m.group(4) or m.group(5)
    return f"state:{m.group(6).rsplit('.', 1)[-1]}" if kind == "state" else kind


class ModelCaseError(ValueError):
    """A model case that cannot be set up as declared (one line naming the parameter or module)."""


@dataclass(frozen=True)
class StepTensor:
    """One tensor of the step, handed over as it is made: its kind (act, loss, dact, dparam, step), its key (the
    module path, "#k" for its k-th call after the first; the parameter name), the tensor (a DTensor's local piece,
    detached) and its layout (a DTensor's own; None for a plain tensor)."""

    kind: str
    key: str
    tensor: torch.Tensor
    layout: Layout | None


@dataclass(frozen=True)
class StepOutputs:
    """What one float64 step on one device names: the case's outputs in step order, the full shape of every tensor
    of the step, and the output name of each (kind, key) the hooks report."""

    names: tuple[str, ...]
    shapes: dict[str, tuple[int, ...]]
    by_key: dict[tuple[str, str, int, int], str]  # (kind, key, optimizer step, micro-batch) -> output name


@dataclass(kw_only=True)
class ModelCase:
    """One model, its parallelization plan and one training step on given inputs.

    `build(gen)` returns the full model on one device, weights drawn from `gen`; `parallelize(model, ctx)` applies
    the plan on this rank (torch's `parallelize_module`, `fully_shard`, or the user's own code holding local shards)
    and returns the model to run.  `model_inputs` are the inputs passed to the model positionally; `loss(outputs,
    inputs, ctx)` makes the scalar loss (ctx is None on the single device; absent: the model's output is the
    loss)."""

    op: str  # "family.Name": Name must exist in the module under test (e.g. the plan's function)
    case_id: str
    build: Callable[[torch.Generator], nn.Module]
    parallelize: Callable[[nn.Module, RankContext], nn.Module]
    make_inputs: Callable[[torch.Generator], Tensors]  # full inputs, floats in float64
    model_inputs: tuple[str, ...] = ("tokens",)
    loss: Callable[[Any, Tensors, RankContext | None], torch.Tensor] | None = None
    input_layouts: dict[str, Layout] = field(default_factory=dict)
    # Layout(dp=Partial()) where each DP rank's loss is its summand of the global one (gradients summed over dp);
    # Layout(dp=Partial("avg")) where it is the mean over the rank's own tokens (gradients averaged: DDP, FSDP2's
    # default, Megatron); cp likewise.
    loss_layout: Layout = REPLICATED
    # Plain-tensor parameters (local shards of the user's own code): glob on the parameter name -> its layout.
    param_layouts: dict[str, Layout] = field(default_factory=dict)
    # Plain-tensor activations whose layout their local shape does not tell: glob on the module path -> layout.
    activation_layouts: dict[str, Layout] = field(default_factory=dict)
    batch: str | None = None  # the input whose dp/cp placements activations default to (None: the first model input)
    # Module paths (globs) whose output is not compared, where the two models give it in different forms that no
    # layout maps (Megatron's vocab-parallel embedding returns [S/TP, B, H] under sequence parallelism and [B, S, H]
    # without): their gradients are not compared either; their parent's output still is.
    unchecked_modules: tuple[str, ...] = ()
    # A context the step runs in on both sides (forward, loss, backward, optimizer step); ctx is None on the single
    # device.  For a framework's process-wide state that must be set while its modules run and undone after
    # (Megatron-Core's RNG tracker and TP group on CPU, a patched forward of the module under test).
    step_context: Callable[[RankContext | None], contextlib.AbstractContextManager] | None = None
    # The activations' dp/cp layout when the step shards the batch itself (cp_utils' head-tail sharding inside the
    # step: Layout(dp=Shard(0), cp=HeadTail(1))); None: the `batch` input's placements.
    batch_layout: Layout | None = None
    # Other families the step calls (`ctx.module(family)`), each resolved by its own --impl (Case.uses).
    uses: tuple[str, ...] = ()
    optimizer: str | OptimizerFn = "sgd"  # "sgd", "adamw", or the plan's own: optimizer(params, lr, ctx)
    lr: float = 0.1
    # The step's shape (docs/model-cases.md, "The training step"): `microbatches` forward/backward passes before each
    # optimizer step, micro-batch j the rows j, j + k, ... of every input with the batch's rows (dim 0); `steps`
    # optimizer steps on the same inputs; clipping by the global norm `clip_grad_norm` before each optimizer step,
    # by `clip_grad(params, max_norm, ctx)` (None: torch's clip_grad_norm_), which returns the total norm.
    microbatches: int = 1
    steps: int = 1
    clip_grad_norm: float | None = None
    clip_grad: ClipFn | None = None
    # FSDP2's MixedPrecisionPolicy the plan applies (fully_shard(mp_policy=...)): the single-device step below float64
    # runs under it too (train_step._low_precision), every budget is param_dtype's (Case.compute_dtype), and float64
    # items are left out.
    mixed_precision: MixedPrecisionPolicy | None = None
    # The dtype the model's own math rounds to somewhere, whatever the item's (torchtitan's RoPE computes in float32):
    # an item in a wider dtype is judged with this one's budgets (Case.compute_dtype), narrower items with their own.
    compute_dtype: torch.dtype | None = None
    dtypes: tuple[str, ...] = ("float64", "float32", "bfloat16")
    supports: Callable[[Topology], bool] = lambda topology: True
    context_parallel: bool | None = None
    hsdp: bool = False  # runs at HSDP topologies (dp split replicate x shard: ctx.data_mesh()), Case.hsdp
    # The plan builds its own DeviceMesh over the world (torchtitan's ParallelDims.build_mesh): run each topology only
    # in a launch of exactly its size (Case.world_group).
    world_group: bool = False
    expert_parallel: bool = False  # Case.expert_parallel: the plan gives it topologies with ep > 1
    # Each sample's module outputs must not depend on its place in the batch or on the other samples: checked after the
    # step, the batch permuted and split (harness/core/model_batch_invariance.py, rows `property:batch_invariant:*`).
    batch_invariance: BatchInvariance | None = None
    xfail: KnownFailure | None = None
    skip_reason: str | None = None
    params: dict = field(default_factory=dict)
    # Set by the methods named, once each: the outputs one step on one device names (outputs), the Case made last
    # (case), whose output layouts each run sets.
    _outputs: StepOutputs | None = field(default=None, init=False, repr=False, compare=False)
    _case: StepCase | None = field(default=None, init=False, repr=False, compare=False)

    def case(self) -> Case:
        """The ordinary Case that runs this model's step.  Its outputs are named by one float64 step of the model on
        one device, run the first time a rank (or the bench) asks for them, not here: loading a suite to plan runs
        no model (the planner plans a model case's checks as its loss alone: PLANNED_CHECKS)."""
        wrong = step_fields_error(self)
        if wrong:
            raise ModelCaseError(f"model case {self.op}[{self.case_id}]: {wrong}")
        for dim, p in zip(MESH_DIMS, self.loss_layout.placements):
            if isinstance(p, Partial) and (p.reduce_op not in ("sum", "avg") or (dim == "tp" and p.reduce_op == "avg")):
                raise ModelCaseError(
                    f"model case {self.op}[{self.case_id}]: loss_layout {dim}={p}; expected Partial() or "
                    'Partial("avg") over dp or cp, Partial() over tp'
                )
        case = StepCase(
            op=self.op,
            case_id=self.case_id,
            make_inputs=self._make_inputs,
            reference=self._reference,
            run=self._run,
            input_layouts=dict(self.input_layouts),
            output_names=("loss",),
            output_layouts=(REPLICATED,),
            budget_scope=BudgetScope.TENSOR,
            compute_dtype=self.mixed_precision.param_dtype if self.mixed_precision is not None else self.compute_dtype,
            dtypes=self._dtypes(),
            supports=self.supports,
            context_parallel=self._uses_cp(),
            hsdp=self.hsdp,
            world_group=self.world_group,
            expert_parallel=self.expert_parallel,
            xfail=self.xfail,
            skip_reason=self.skip_reason,
            params={"model": True, **self.params},
            uses=tuple(self.uses),
            properties=model_batch_invariance(self, self.batch_invariance) if self.batch_invariance else None,
        )
        case.model = self
        self._case = case
        return case

    def _dtypes(self) -> tuple[str, ...]:
        """The item dtypes: under a mixed-precision policy not float64 (its golden is the step without the policy,
        and a float64 item's budget is float64's own)."""
        if self.mixed_precision is None:
            return self.dtypes
        kept = tuple(d for d in self.dtypes if d != "float64")
        if not kept:
            raise ModelCaseError(f"model case {self.op}[{self.case_id}]: mixed_precision needs a dtype below float64")
        return kept

    def outputs(self) -> tuple[str, ...]:
        """The case's output names in step order, from one float64 step on one device: run once, the first time they
        are asked for (a skipped case never builds its model, its framework may be missing: its one check, the
        loss, is a skip)."""
        if self._outputs is None:
            order = (
                {"loss": torch.zeros(())}
                if self.skip_reason is not None
                else self._step_on_one_device(self._order_inputs())
            )
            names = tuple(n for n in order if not self._unchecked(n))
            self._outputs = StepOutputs(
                names=names,
                shapes={n: tuple(t.shape) for n, t in order.items()},
                by_key={_key_of(n): n for n in names},
            )
        return self._outputs.names

    def named(self) -> bool:
        """Whether `outputs` has run in this process (without running it)."""
        return self._outputs is not None

    def data_inputs(self, gen: torch.Generator) -> Tensors:
        """The model's inputs without its weights (no model is built): what the planner lays out at a topology."""
        return self.make_inputs(gen)

    def _unchecked(self, name: str) -> bool:
        kind, key, _, _ = _key_of(name)
        path = key.split("#")[0]
        return kind in ("act", "dact") and any(
            fnmatch.fnmatchcase(path if path != ROOT_NAME else "", pat) for pat in self.unchecked_modules
        )

    # ---------------------------------------------------------------------------------------------- inputs

    def _make_inputs(self, gen: torch.Generator) -> Tensors:
        model = self.build(gen)
        inputs = self.make_inputs(gen)
        clash = [n for n in inputs if n.startswith(PARAM_PREFIX)]
        if clash:
            raise ModelCaseError(
                f"model case {self.op}[{self.case_id}]: input names {clash} start with {PARAM_PREFIX!r}"
            )
        weights = {PARAM_PREFIX + n: p.detach().to(torch.float64) for n, p in model.named_parameters()}
        return {**inputs, **weights}

    def _order_inputs(self) -> Tensors:
        return self._make_inputs(torch.Generator().manual_seed(0))

    def _uses_cp(self) -> bool:
        if self.context_parallel is not None:
            return self.context_parallel
        return any(not isinstance(lay.placements[1], Replicate) for lay in self.input_layouts.values())

    # ---------------------------------------------------------------------------------------------- one device

    def _fresh_model(self, inputs: Tensors, device: torch.device | None = None) -> nn.Module:
        """The model with the case's full weights, in their dtype, on `device`."""
        model = self.build(torch.Generator().manual_seed(0))
        dtype = next((v.dtype for k, v in inputs.items() if k.startswith(PARAM_PREFIX)), torch.float64)
        model = model.to(dtype=dtype, device=device)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(inputs[PARAM_PREFIX + name])
        return model

    def _step_on_one_device(self, inputs: Tensors) -> dict[str, torch.Tensor]:
        """{output name: full tensor} of one step of the single-device model, names in execution order."""
        model = self._fresh_model(inputs)
        data = {k: v for k, v in inputs.items() if not k.startswith(PARAM_PREFIX)}
        made: list[Made] = []
        # a copy: a module may change its output in place later
        batches = microbatches(self, data, {k: tuple(v.shape) for k, v in data.items()})
        run_step(self, model, batches, None, lambda m: made.append(replace(m, tensor=m.tensor.clone())))
        got, counts = {}, {}
        for m in sorted(made, key=lambda m: step_order("forward:" + _name(m.kind, 0, m.key, m.step, m.microbatch))):
            i = counts[m.kind, m.step, m.microbatch] = counts.get((m.kind, m.step, m.microbatch), -1) + 1
            got[_name(m.kind, i, m.key, m.step, m.microbatch)] = m.tensor
        return got

    def _reference(self, inputs: Tensors) -> tuple:
        got = self._step_on_one_device(inputs)
        return tuple(got.get(n) for n in self.outputs())

    # ---------------------------------------------------------------------------------------------- this rank

    def _run(self, impl, ctx: RankContext, local: Tensors) -> tuple:
        names = self.outputs()
        model = self.parallel_model(ctx, local)
        data = {k: v for k, v in local.items() if not k.startswith(PARAM_PREFIX)}
        default = self._batch_layout()
        scale = self._gradient_scale(ctx)
        got: dict[str, tuple[torch.Tensor | None, Layout]] = {}
        full_shapes = {n: tuple(s) for n, s in ctx.full_shapes.items()}
        sizes = mesh_dims(ctx.mesh).sizes

        def arrive(made: Made) -> None:
            # an activation on the tp sub-mesh is still split over dp/cp as the batch
            absent = default if made.kind in (Kind.ACT, Kind.DACT) else REPLICATED
            step = _step_tensor(made.kind, made.key, made.tensor, absent, sizes)
            name = self._outputs.by_key.get((step.kind, step.key, made.step, made.microbatch))
            if name is None:  # a module call the single-device model does not make: nothing to compare with
                return
            layout = self._layout_of(step, name, default, ctx)
            if step.kind == "dact" and scale != 1:  # the averaged convention: each rank's gradient `scale` times
                step = StepTensor(step.kind, step.key, step.tensor / scale, step.layout)
            # Judged as it comes (the harness keeps a summary, and the tensors of the first divergence only), so that
            # the rank never holds every module's output and gradient at once; else a copy, returned below.
            judged = ctx.judge_output is not None and ctx.judge_output(name, step.tensor, layout)
            if not judged and isinstance(layout, DTensorPiece):  # judged after the run, as a Layout says: whole
                whole = made.tensor.full_tensor().detach()
                whole = whole / scale if step.kind == "dact" and scale != 1 else whole
                step, layout = StepTensor(step.kind, step.key, whole, REPLICATED), REPLICATED
            got[name] = (None if judged else step.tensor.clone(), layout)

        run_step(self, model, microbatches(self, data, full_shapes), ctx, arrive)
        outs = [got.get(n, (None, REPLICATED)) for n in names]
        self._case.output_layouts = tuple(lay for _, lay in outs)  # read by the harness after this run, this item
        return tuple(t for t, _ in outs)

    def parallel_model(self, ctx: RankContext, local: Tensors) -> nn.Module:
        """The model made on this rank, parallelized by the plan, holding its pieces of the case's full weights."""
        model = self.parallelize(self._fresh_model(local, ctx.device), ctx)
        self._put_full_weights(model, local, ctx)
        return model

    def _layout_of(self, step: StepTensor, name: str, default: Layout, ctx: RankContext) -> Layout:
        """The layout of a sharded tensor of the step (output `name`): a DTensor's own, else the declared or inferred
        one (`default`: the batch's)."""
        layout = step.layout
        if layout is None and step.kind in ("act", "dact"):
            path = step.key.split("#")[0]
            declared = next(
                (
                    lay
                    for pat, lay in self.activation_layouts.items()
                    if fnmatch.fnmatchcase(path if path != ROOT_NAME else "", pat)
                ),
                None,
            )
            if declared is not None and step.kind == "dact":  # a summand's gradient is the whole gradient
                declared = Layout(*[Replicate() if isinstance(p, Partial) else p for p in declared.placements])
            layout = declared or layout_by_shape(tuple(step.tensor.shape), self._outputs.shapes[name], default, ctx)
            if step.kind == "dact":
                layout = gradient_over_batch(layout, default, mesh_dims(ctx.mesh).sizes)
        elif layout is None and step.kind in ("dparam", "step"):
            layout = _param_layout(step.key, self.param_layouts)
        elif layout is None and step.kind == "state":  # a state with its parameter's shape is laid out as it is
            param, state = step.key.rsplit(".", 1)
            full = self._outputs.shapes[f"step:{param}"]
            layout = _param_layout(param, self.param_layouts) if self._outputs.shapes[name] == full else REPLICATED
        elif step.kind == "grad_norm":
            layout = REPLICATED
        return layout if layout is not None else self.loss_layout

    def _gradient_scale(self, ctx: RankContext) -> int:
        """How many times its share of the whole gradient each rank's activation gradients are: the product of the
        sizes of the mesh dims the loss is averaged over (`Partial("avg")`: each rank's loss is the mean over its
        own tokens, so its backward is that many times its share); 1 in the sum convention."""
        sizes = mesh_dims(ctx.mesh).sizes
        scale = 1
        for dim, p in zip(MESH_DIMS, self.loss_layout.placements):
            if isinstance(p, Partial) and p.reduce_op == "avg":
                scale *= sizes[dim]
        return scale

    def _batch_layout(self) -> Layout:
        """The layout an activation defaults to: the batch's placements over dp and cp, replicated over tp."""
        batch = self.batch_layout or self.input_layouts.get(self.batch or self.model_inputs[0], REPLICATED)
        return Layout(dp=batch.placements[0], cp=batch.placements[1])

    def _put_full_weights(self, model: nn.Module, local: Tensors, ctx: RankContext) -> None:
        """Every parameter of the sharded model gets its piece of the same full weights the single-device one has."""
        flat = flat_parameters(model)
        if flat:
            raise ModelCaseError(flat)
        sizes = mesh_dims(ctx.mesh).sizes
        with torch.no_grad(), gathered(model, writeback=True):
            for name, p in OriginalNames(model).parameters(model):
                full = local.get(PARAM_PREFIX + name)
                if full is None:
                    raise ModelCaseError(
                        f"the sharded model's parameter {name!r} is not a parameter of the model "
                        "build() returns: keep the parameter names (parallelize in place)"
                    )
                if isinstance(p, DTensor) and not _mapped(
                    p, sizes
                ):  # FSDP over a flattened mesh, a TP shard sharded again
                    target = p.to_local()
                    piece = DTensorPiece(p.device_mesh, tuple(p.placements)).local(full.to(target.dtype))
                    if tuple(piece.shape) != tuple(target.shape):
                        raise ModelCaseError(
                            f"parameter {name!r}: local shape {tuple(target.shape)}, its placements "
                            f"{p.placements} give {tuple(piece.shape)} of the full "
                            f"{tuple(full.shape)}"
                        )
                    target.copy_(piece)
                    continue
                if isinstance(p, DTensor):
                    layout, target = _dtensor_layout(p), p.to_local()
                else:
                    layout, target = _param_layout(name, self.param_layouts), p
                piece = layout.local(full, ctx.mesh)
                if tuple(piece.shape) != tuple(target.shape):
                    raise ModelCaseError(
                        f"parameter {name!r}: local shape {tuple(target.shape)} matches no layout "
                        f"({layout} gives {tuple(piece.shape)} of the full {tuple(full.shape)}); declare it in "
                        "param_layouts, e.g. {'*.weight': Layout(tp=Shard(0))}"
                    )
                target.copy_(piece)


# What the planner plans of a model case (its outputs are named by running it, which planning does not): the loss,
# which every model case has.  The ranks report every check; a model item that does not run (skipped, or its ranks
# died) has this one row.
PLANNED_CHECKS = ("forward:loss",)


class StepCase(Case):
    """The Case a ModelCase makes: `output_names` (and the layouts before a run sets them) are its ModelCase's,
    asked of it the first time something needs them (ModelCase.outputs), not when the case is made."""

    model: ModelCase | None = None
    # What the setters were given (Case's __init__, then each run's layouts): the output names until `model` is set,
    # the layouts once they are one per output.
    _given_names: tuple[str, ...] = ()
    _given_layouts: tuple[Layout, ...] = ()

    @property
    def output_names(self) -> tuple[str, ...]:
        return self.model.outputs() if self.model is not None else self._given_names

    @output_names.setter
    def output_names(self, names: tuple[str, ...]) -> None:
        self._given_names = tuple(names)

    @property
    def output_layouts(self) -> tuple[Layout, ...]:
        if self.model is not None and len(self._given_layouts) != len(self.output_names):  # before the first run
            return tuple(REPLICATED for _ in self.output_names)
        return self._given_layouts

    @output_layouts.setter
    def output_layouts(self, layouts: tuple[Layout, ...]) -> None:
        self._given_layouts = tuple(layouts)

    def misfit(self, topology: Topology, inputs: Tensors) -> str:
        """Case.misfit, and micro-batches: each rank's piece of the batch must split into them evenly (so that its
        pieces are its pieces of the whole batch's micro-batches)."""
        k = self.model.microbatches if self.model is not None else 1
        name = self.model.batch or self.model.model_inputs[0] if self.model is not None else None
        layout = self.input_layouts.get(name, REPLICATED)
        if k > 1 and name in inputs and isinstance(layout.placements[0], Shard) and topology.dp > 1:
            rows = batch_rows(inputs, name)
            if rows is not None and rows % (k * topology.dp):
                return (
                    f"input {name!r} of {rows} rows cannot be split into {k} micro-batches at {topology}: each DP "
                    f"rank's piece must be a multiple of {k} rows (a multiple of microbatches·dp = {k * topology.dp})"
                )
        return super().misfit(topology, inputs)

    def planning_inputs(self, gen: torch.Generator) -> Tensors:
        """The inputs the planner lays out (Case.misfit): the model's data alone, its weights left unbuilt."""
        return self.model.data_inputs(gen) if self.model is not None else self.make_inputs(gen)


def _name(kind: str, index: int, key: str, step: int = 0, microbatch: int = 0) -> str:
    """The output (check) name: activations carry their execution order, so that the first diverging one is known;
    a later optimizer step or micro-batch (from 0 here) its place."""
    where = ".".join(([f"step{step + 1}"] if step else []) + ([f"mb{microbatch + 1}"] if microbatch else []))
    head = (
        f"{kind}{index:02d}:{key}"
        if kind in ("act", "dact")
        else kind
        if kind in ("loss", "grad_norm")
        else f"{kind}:{key}"
    )
    return head + (f"@{where}" if where else "")


def _key_of(name: str) -> tuple[str, str, int, int]:
    """(kind, key, optimizer step, micro-batch) of an output name (_name's inverse)."""
    head, _, where = name.partition("@")
    places = dict.fromkeys(("step", "mb"), 0)
    for part in where.split(".") if where else ():
        label = part.rstrip("0123456789")
        places[label] = int(part[len(label) :]) - 1
    kind, _, key = head.partition(":")
    kind = kind.rstrip("0123456789")
    return kind, key or kind, places["step"], places["mb"]


def _step_tensor(kind: str, key: str, t: torch.Tensor, absent: Layout, sizes: dict[str, int]) -> StepTensor:
    """A tensor of the step as it is compared: a DTensor's local piece and its layout (`absent`: the placements over
    mesh dims its mesh lacks; `sizes`: the harness's mesh dims), a plain tensor and None."""
    if isinstance(t, DTensor) and not _mapped(t, sizes):
        # FSDP2's parameters and gradients on the flattened dp x cp mesh (and a TP shard sharded again over it,
        # _StridedShard): no Layout of the (dp, cp, tp) mesh describes them; the piece is judged where it is, laid
        # out as the DTensor is (a partial sum: the full tensor)
        piece = DTensorPiece.of(t)
        if piece is None:
            return StepTensor(kind, key, t.full_tensor().detach(), REPLICATED)
        return StepTensor(kind, key, t.to_local().detach(), piece)
    if isinstance(t, DTensor):
        return StepTensor(kind, key, t.to_local().detach(), _dtensor_layout(t, absent))
    return StepTensor(kind, key, t.detach(), None)


def _mapped(t: DTensor, sizes: dict[str, int]) -> bool:
    """Whether a Layout describes this DTensor: its mesh dims among dp/cp/tp (and ep/edp) with the harness's sizes
    (a framework's own mesh may name a dim "ep" over the tp ranks), plain Shard/Replicate/Partial."""
    names = t.device_mesh.mesh_dim_names or ()
    if any(t.device_mesh.size(i) != sizes.get(n, -1) for i, n in enumerate(names)):
        return False
    by_name = dict(zip(names, t.placements))
    experts = (  # on the expert mesh (topology.expert_mesh): sharded over ep, whole or summed over edp
        not ({"ep", "edp"} & set(names))
        or ("dp" not in names and type(by_name.get("ep", Replicate())) in (Shard, Replicate))
        and type(by_name.get("edp", Replicate())) in (Replicate, Partial)
    )
    return (
        experts
        and all(n in MESH_DIMS + EXPERT_DIMS for n in names)
        and all(type(p) in (Shard, Replicate, Partial) for p in t.placements)
    )


def _dtensor_layout(t: DTensor, absent: Layout = REPLICATED) -> Layout:
    """The Layout of a DTensor on (a sub-mesh of) the ("dp", "cp", "tp") mesh (Partial: the harness sums the pieces);
    a mesh dim the DTensor's mesh lacks takes its placement in `absent`."""
    names = t.device_mesh.mesh_dim_names or ()
    kw = {d: p for d, p in zip(MESH_DIMS, absent.placements) if d not in names}
    for name, placement in zip(names, t.placements):
        if name in EXPERT_DIMS:  # ep's placement is the Layout's own; edp's is dp's (Partial: summed over edp)
            kw["ep" if name == "ep" else "dp"] = placement
            continue
        if name not in MESH_DIMS:
            raise ModelCaseError(f"a DTensor on mesh dim {name!r}: only {MESH_DIMS} (or sub-meshes of them) are mapped")
        kw[name] = placement
    return Layout(**kw)


def _param_layout(name: str, layouts: dict[str, Layout]) -> Layout:
    return next((lay for pat, lay in layouts.items() if fnmatch.fnmatchcase(name, pat)), REPLICATED)
