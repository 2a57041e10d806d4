"""What a suite declares about one case of one op.

A suite (suites/<family>.py) returns a list of `Case`.  Each case says how to make
the full inputs, how to call the single-device reference on them, how to call the
implementation under test on one rank's local inputs, and how every input and output
is laid out over the ("dp", "cp", "tp") mesh.  The harness does the rest: slicing,
golden values and gradients, comparison on every rank, records.

What a case is made of lives beside it, one idea per module: layouts and CP index rules (layout), where a check's
rule comes from (citations), input outside the contract (bad_input), what a run asks of its rank (rank_context),
known failures (known_failure), memory models (memory_model), fuzz spaces (fuzz_space), the DDP stand-in (grad_sum).
`shardcheck` (shardcheck/__init__.py) is the one place a suite imports them from.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch.distributed.tensor import Replicate

from shardcheck.harness.core.bad_input import BAD_INPUT_CHECK, BadInput
from shardcheck.harness.core.citations import COMM_RULE, DOCUMENTED_RESULT, SIGNATURE_RULE, OutsideSeed, Rule
from shardcheck.harness.core.compare import BudgetScope
from shardcheck.harness.core.grad_convention import GradConvention
from shardcheck.harness.core.known_failure import KnownFailure
from shardcheck.harness.core.layout import REPLICATED, Layout, Tensors
from shardcheck.harness.core.memory_model import MemoryModel
from shardcheck.harness.core.rank_context import RankContext
from shardcheck.harness.core.records import SIGNATURE_CHECK, Symptom
from shardcheck.harness.core.topology import MESH_DIMS, Topology


def as_tuple(out) -> tuple:
    """An op's result as a tuple of outputs."""
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def is_float(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


@dataclass
class Property:
    """Result of a `property:<name>` check on one rank.  `rule`: where the property's rule comes from (else the
    case's `rules` name it)."""

    name: str
    passed: bool
    value: float | None = None
    message: str = ""
    rule: Rule | None = None


# run(impl_module, ctx, local_inputs) -> output tensor or tuple of output tensors
RunFn = Callable[[ModuleType, RankContext, Tensors], Any]
# properties(ctx, full_inputs, local_inputs, local_outputs) -> list of Property
PropertiesFn = Callable[[RankContext, Tensors, Tensors, tuple], list[Property]]


@dataclass(frozen=True)
class PrecisionOnly:
    """What an output check returns where the values are the golden's rounded exactly to the lower dtype the op
    returned (`returned`: float64 values returned as float32): a `warn` under our precision rule (core/rules.py), the
    finding the numeric check calls "float64 computed in float32" (a bfloat16 return: "bfloat16 math"), where the
    seed may state no dtype for the output.  A wrong value is (False, message), a failure under any rule."""

    returned: torch.dtype
    message: str

    def __post_init__(self):
        if self.returned not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"PrecisionOnly names the lower dtype returned (float32, bfloat16), got {self.returned}")

    @property
    def symptom(self) -> Symptom:
        return Symptom.PRECISION_FLOAT32 if self.returned == torch.float32 else Symptom.PRECISION_BFLOAT16


# comparator for one output: (got_local, golden_local, full_inputs, local_inputs, ctx) -> (passed, message), or a
# PrecisionOnly finding
OutputCheck = Callable[[torch.Tensor, torch.Tensor, Tensors, Tensors, RankContext], "tuple[bool, str] | PrecisionOnly"]


@dataclass(kw_only=True)
class Case:
    """One case of one op: its inputs, the two calls, the layouts, and what else is checked.

    Keyword-only.  Only `op`, `case_id`, `make_inputs`, `reference` and `run` are required; a case whose
    inputs and outputs are all replicated needs nothing else, a sharded one adds its layouts.  The fields
    below are grouped by purpose."""

    # ---- what the case is
    op: str  # "family.Name": Name must exist in the module under test
    case_id: str  # unique within the op; what `--case GLOB` matches

    # ---- the inputs and the two calls
    make_inputs: Callable[[torch.Generator], Tensors]  # full inputs; floats in float64 (the harness casts them)
    reference: Callable[[Tensors], Any]  # full inputs -> full output(s), on one device
    run: RunFn  # (module under test, ctx, this rank's local inputs) -> this rank's local output(s)

    # Other families whose modules under test the run calls (`ctx.module(family)`), each resolved by its own
    # `--impl` (a model case's training step calling model_utils, cp_utils, ...); named in run.json and reruns.
    uses: tuple[str, ...] = ()

    # ---- layouts: how each full tensor maps to a rank's piece
    input_layouts: dict[str, Layout] = field(default_factory=dict)  # absent = replicated
    output_layouts: tuple[Layout, ...] = (REPLICATED,)  # one per output
    output_names: tuple[str, ...] = ("out",)  # one per output; () for a properties-only case

    # ---- gradients
    grad_inputs: tuple[str, ...] = ()  # inputs whose gradients are checked (floating inputs only)
    # Mesh dims along which each rank's output is a separate summand of the loss
    # (e.g. a CP all-gather used by every CP rank): each rank then gets its own
    # upstream gradient and the golden gradient is that of the sum.
    summed_over: tuple[str, ...] = ()
    # The gradients accepted for those summands, where the seed does not fix its backward's convention: the golden of
    # the sum of every rank's upstream gradient (SUMMED), and/or of each rank's own one (OWN: DTensor's backward of a
    # replicated output).  A gradient row records the one its ranks matched (`grad_convention`).
    grad_conventions: tuple[GradConvention, ...] = (GradConvention.SUMMED,)

    # ---- extra checks
    output_checks: dict[str, OutputCheck] = field(default_factory=dict)  # replaces the numeric forward check
    properties: PropertiesFn | None = None  # each Property it returns is a `property:<name>` row
    # Communication contract: ctx -> {"forward"|"backward": {"<kind>@<mesh dim>": (max calls, max bytes)}}
    # per rank; doing more (or a kind/dim not listed) is reported on `property:comm`.
    comm: Callable[[RankContext], dict] | None = None
    # Memory model (`--bench`): ctx -> the per-rank peak the op should reach from its shapes (`MemoryModel`); the
    # bench row and report put it beside the measured peak, so a tracker error or a materialised tensor shows.
    memory: Callable[[RankContext], MemoryModel] | None = None
    # Input outside the op's contract: the op must raise or return the documented interpretation's answer
    # (`BadInput`); one `property:bad_input` row unless it returns.
    bad_input: BadInput | None = None
    # A known defect of the code under test (an upstream issue): the checks it covers are recorded `xfail`
    # while they fail and `xpass` once they pass on every rank (`KnownFailure`).
    xfail: KnownFailure | None = None

    # What one low-precision budget covers: a row of each output and gradient (the last dim), or the whole tensor.
    budget_scope: BudgetScope = BudgetScope.ROW
    # The dtype the outputs are computed in where it is below theirs (a model step under a mixed-precision policy: bf16
    # work, float32 gradients and parameters; a model whose RoPE rounds to float32): their budgets are that dtype's
    # where it is the narrower (judge.Budget.budget_dtype).  None: each output's own dtype.
    compute_dtype: torch.dtype | None = None

    # ---- where it runs
    dtypes: tuple[str, ...] = ("float64", "float32", "bfloat16")
    supports: Callable[[Topology], bool] = lambda topology: True
    # Whether the case exercises the CP axis.  None: derived from the layouts (something is
    # sharded over "cp", or the outputs are summands over it).  A case that does not would run
    # the same computation on every CP rank, so topologies with cp > 1 skip it.  Ops that shard
    # over CP by themselves (full inputs in, e.g. cp_utils' context) say True.
    context_parallel: bool | None = None
    # Whether the case runs at topologies whose dp is split replicate x shard (HSDP, `--topology dp=4,dp_replicate=2`;
    # the plan's data mesh: RankContext.data_mesh()).  Other cases never get them: they would run as at plain dp.
    hsdp: bool = False
    # The op communicates over the default (world) process group rather than the mesh's groups (e.g.
    # inbatch_neg_utils' gathers): each topology then runs only in a launch whose world size equals
    # its size, so no spare rank is missing from the op's collectives; a topology whose size is not
    # one of the launched world sizes is skipped for this case.
    world_group: bool = False
    # The case runs expert parallelism (its run reads ctx.group("ep") / ctx.group("edp")): the plan gives it the
    # topologies with ep > 1 too (topology.expert_topologies); the others never see them.
    expert_parallel: bool = False
    # The mesh dims over which the case tests pieces that are empty on some ranks (a Shard over a dim smaller than
    # the mesh dim: V < TP, or V = 33 at TP 8, whose last rank gets nothing): ("tp",) where the op supports a rank
    # holding no vocab entries.  Elsewhere the plan skips, with the reason, a topology at which an input would
    # leave a rank an empty piece (Case.misfit).
    empty_pieces: tuple[str, ...] = ()
    # The mesh dims over which the case tests Shard pieces of unequal lengths (V = 37 at TP 2). Not CP by default:
    # context parallelism splits a sequence into equal pieces (a CP op exchanges equal chunks), so the plan skips,
    # with the reason, a topology at which a Shard over CP would not split its dim evenly (16 positions at CP 3).
    uneven_pieces: tuple[str, ...] = ("dp", "tp")
    # Sequence lengths an op that shards over CP by itself (full inputs in) splits head-tail: each must be a
    # multiple of 2·CP, and the plan skips, with the reason, the CP sizes where one is not.
    cp_lengths: tuple[int, ...] = ()
    # Set when the case cannot run here (e.g. an optional dependency is missing): every check of every
    # item is recorded `skip` with this reason, and nothing of the case is called.
    skip_reason: str | None = None

    # Where the family's contract lets a float64 item be computed (and returned) in float32, the rule that says so
    # ("seed: 'Cast logits to float32 ...'", "ours: docs/ops/x.md#section"): a float64 result within the float32
    # budget then passes, citing it, instead of warning "float64 computed in float32".
    allows_float32: str | None = None
    # ---- where each check's rule comes from (RuleSource): `rule` for the value and gradient checks (ours where the
    # case's inputs are outside the seed's stated shapes), `rules` for properties and output checks by check-name
    # pattern ("property:padding_mask", "property:reassembled:*", "forward:ids"), unless a Property carries its own.
    rule: Rule = DOCUMENTED_RESULT
    rules: dict[str, Rule] = field(default_factory=dict)
    # Input the seed does not describe, everywhere or at some topologies (targets outside [0, V); V = 37 at TP 2 where
    # the seed's shard is vocab_size//TP): where one holds, the case's checks are judged under its rule of ours, the
    # first that holds (rule_of).  The harness's own checks and a bad input's rule keep theirs.
    outside_seed: tuple[OutsideSeed, ...] = ()
    # ---- parameters: recorded with every row, and what `run` (and every other callable given a ctx) reads
    # as `ctx.params`
    params: dict = field(default_factory=dict)

    def __post_init__(self):
        # Mistakes a suite author makes, caught when the suite is loaded rather than as a silent no-op later.
        where = f"case {self.op}[{self.case_id}]"
        family, dot, name = self.op.partition(".")
        if not (family and dot and name):
            raise ValueError(f"{where}: op must be 'family.Name', got {self.op!r}")
        if len(set(self.output_names)) != len(self.output_names):
            raise ValueError(f"{where}: duplicate output name in {self.output_names}")
        if len(self.output_layouts) != len(self.output_names):
            raise ValueError(
                f"{where}: {len(self.output_layouts)} output layout(s) for {len(self.output_names)} "
                f"output(s) {self.output_names}: give one Layout per output"
            )
        unknown = sorted(set(self.output_checks) - set(self.output_names))
        if unknown:
            raise ValueError(f"{where}: output_checks for {unknown}, not among the outputs {self.output_names}")
        if not set(self.empty_pieces) <= set(MESH_DIMS):
            raise ValueError(f"{where}: empty_pieces {self.empty_pieces} names a dim outside {MESH_DIMS}")
        if not set(self.uneven_pieces) <= set(MESH_DIMS):
            raise ValueError(f"{where}: uneven_pieces {self.uneven_pieces} names a dim outside {MESH_DIMS}")
        if not set(self.summed_over) <= set(MESH_DIMS):
            raise ValueError(f"{where}: summed_over {self.summed_over} names a dim outside {MESH_DIMS}")
        if not self.grad_conventions or (GradConvention.OWN in self.grad_conventions and not self.summed_over):
            raise ValueError(
                f"{where}: grad_conventions {self.grad_conventions} needs summands (summed_over) to differ"
            )
        for name, layout in [*self.input_layouts.items(), *zip(self.output_names, self.output_layouts)]:
            if not isinstance(layout, Layout):
                raise ValueError(
                    f"{where}: the layout of {name!r} is {layout!r}; expected a Layout, e.g. Layout(tp=Shard(-1))"
                )

    def rule_of(self, check: str, prop: Property | None = None, topology: Topology | None = None) -> Rule | None:
        """Where the rule of `check` comes from at `topology` (None: the rules that hold at every topology; None
        returned: nobody cited it, a suite of someone else's)."""
        if check == BAD_INPUT_CHECK and self.bad_input is not None and self.bad_input.rule is not None:
            return self.bad_input.rule
        if check == "property:comm":  # the harness's own checks, whatever a suite's catch-all pattern says
            return COMM_RULE
        if check == SIGNATURE_CHECK:
            return SIGNATURE_RULE
        outside = next((o.rule for o in self.outside_seed if o.holds_at(topology)), None)
        if outside is not None:  # the input decides, whatever the check
            return outside
        if prop is not None and prop.rule is not None:
            return prop.rule
        for pattern, rule in self.rules.items():
            if check != "property:properties" and fnmatch.fnmatchcase(check, pattern):
                return rule
        if check.startswith(("forward", "grad:")) or check == "property:properties":  # (the run raised: its result)
            return self.bad_input.rule if self.bad_input is not None and self.bad_input.rule is not None else self.rule
        return None

    def runs_on(self, topology: Topology) -> bool:
        """Whether the plan gives this case `topology`."""
        if topology.cp > 1 and not self.uses_cp:
            return False
        if topology.dp_replicate > 1 and not self.hsdp:  # a data mesh split replicate x shard: where asked for
            return False
        if topology.ep > 1 and not self.expert_parallel:
            return False
        return self.supports(topology)

    def misfit(self, topology: Topology, inputs: Tensors) -> str:
        """Why the case's full `inputs` cannot be laid out at `topology` (the first input that cannot, in words), or
        "" where they can: what the plan records as the item's skip reason instead of running it."""
        sizes = {"dp": topology.dp, "cp": topology.cp, "tp": topology.tp, "ep": topology.ep}
        for length in self.cp_lengths:
            if topology.cp > 1 and length % (2 * topology.cp):
                return (
                    f"a sequence of {length} cannot be split head-tail at {topology}: the op needs a multiple of "
                    f"2·CP = {2 * topology.cp}"
                )
        for name, layout in self.input_layouts.items():
            if name in inputs and layout is not REPLICATED:
                why = layout.misfit(tuple(inputs[name].shape), sizes, inputs, self.empty_pieces, self.uneven_pieces)
                if why:
                    return f"input {name!r} {list(inputs[name].shape)} cannot be laid out at {topology}: {why}"
        return ""

    @property
    def uses_cp(self) -> bool:
        if self.context_parallel is not None:
            return self.context_parallel
        layouts = [*self.input_layouts.values(), *self.output_layouts]
        return "cp" in self.summed_over or any(not isinstance(lay.placements[1], Replicate) for lay in layouts)

    @property
    def forward_checks(self) -> list[str]:
        """The check names of the outputs: `forward`, or `forward:<name>` for each of several."""
        return ["forward"] if len(self.output_names) == 1 else [f"forward:{n}" for n in self.output_names]

    @property
    def family(self) -> str:
        return self.op.split(".", 1)[0]

    @property
    def name(self) -> str:
        return self.op.split(".", 1)[1]


def cite(cases: list, rules: dict[str, Rule], bad_input: Rule | None = None) -> list:
    """`cases`, each given a suite's rules (check-name pattern -> Rule) for the checks it does not cite itself, and
    `bad_input` for a BadInput that names no rule of its own.  What a suite's `cases()` returns through."""
    for case in cases:
        if not isinstance(case, Case):
            continue
        case.rules = {**case.rules, **{k: v for k, v in rules.items() if k not in case.rules}}
        if case.bad_input is not None and case.bad_input.rule is None and bad_input is not None:
            case.bad_input = dataclasses.replace(case.bad_input, rule=bad_input)
    return cases
