"""What a suite declares about one case of one op.

A suite (suites/<family>.py) returns a list of `Case`.  Each case says how to make
the full inputs, how to call the single-device reference on them, how to call the
implementation under test on one rank's local inputs, and how every input and output
is laid out over the ("dp", "cp", "tp") mesh.  The harness does the rest: slicing,
golden values and gradients, comparison on every rank, records.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import fnmatch
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from shardcheck.harness.core.compare import BudgetScope
from shardcheck.harness.core.records import SIGNATURE_CHECK, Status
from shardcheck.harness.core.topology import MESH_DIMS, Topology, mesh_dims

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class HeadTail:
    """Load-balanced ("head-tail") CP layout of tensor dim `dim`: the positions are split into
    2·n equal chunks and rank r of n holds chunk r followed by chunk 2·n−1−r (cp=2, 16
    positions: rank 0 holds 0–3 and 12–15, rank 1 holds 4–11)."""

    dim: int

    def positions(self, length: int, n: int, r: int, inputs: Tensors) -> torch.Tensor:
        return head_tail_positions(length, n, r)


@dataclass(frozen=True)
class PackedHeadTail:
    """The head-tail layout applied to each packed sequence on its own: the sequences' padded
    boundaries are the full offsets in input `boundaries` ([B+1], e.g. cu_seqlens_padded); rank r
    holds its two chunks of every sequence, sequences in order."""

    dim: int
    boundaries: str = "cu_seqlens_padded"

    def positions(self, length: int, n: int, r: int, inputs: Tensors) -> torch.Tensor:
        bounds = [int(b) for b in inputs[self.boundaries]]
        if bounds[0] != 0 or bounds[-1] != length:
            raise ValueError(f"{self.boundaries} {bounds} does not span the {length} positions of dim {self.dim}")
        return torch.cat([a + head_tail_positions(b - a, n, r) for a, b in zip(bounds[:-1], bounds[1:])])


@dataclass(frozen=True)
class Permuted:
    """An explicit CP layout: input `index` ([L], a permutation of the positions) lists the positions
    in the order the ranks hold them; rank r of n holds the r-th contiguous 1/n of that list."""

    dim: int
    index: str = "seq_index"

    def positions(self, length: int, n: int, r: int, inputs: Tensors) -> torch.Tensor:
        order = inputs[self.index].long()
        if sorted(order.tolist()) != list(range(length)) or length % n:
            raise ValueError(f"{self.index} must be a permutation of {length} positions divisible by {n}")
        return order.view(n, length // n)[r]


IndexRule = HeadTail | PackedHeadTail | Permuted


def head_tail_positions(length: int, n: int, r: int) -> torch.Tensor:
    """Positions rank r of n holds in the head-tail layout of `length` positions."""
    if length % (2 * n):
        raise ValueError(f"head-tail layout needs a length divisible by 2·CP = {2 * n}, got {length}")
    chunk = length // (2 * n)
    return torch.cat(
        [torch.arange(r * chunk, (r + 1) * chunk), torch.arange((2 * n - 1 - r) * chunk, (2 * n - r) * chunk)]
    )


class Layout:
    """How a full tensor maps to each rank's local tensor: one placement per mesh dim.

    A placement is a DTensor placement (`Shard(d)`, `Replicate()`, `Partial()`) or an index rule
    (`HeadTail(d)`, `PackedHeadTail(d)`, `Permuted(d)`: CP layouts that are not DTensor
    placements).  Either way a rank's piece is, per tensor dim, a list of global positions (mesh
    dims apply in order dp, cp, tp, each splitting what the previous left): `indices` gives them,
    and slicing, rebuilding and the mismatch's global index all go through it.

    `Partial()` on a dim means the full value is the *sum* of the ranks' local values
    there (e.g. per-DP-rank losses normalised by the global token count): the harness
    sums them before comparing, and every rank gets the full upstream gradient.
    """

    def __init__(
        self,
        dp: Placement | IndexRule | None = None,
        cp: Placement | IndexRule | None = None,
        tp: Placement | IndexRule | None = None,
    ):
        self.placements = tuple(p if p is not None else Replicate() for p in (dp, cp, tp))

    def __repr__(self) -> str:
        return "Layout(" + ", ".join(f"{d}={p}" for d, p in zip(MESH_DIMS, self.placements)) + ")"

    @property
    def has_rules(self) -> bool:
        return any(isinstance(p, IndexRule) for p in self.placements)

    def indices(
        self, full_shape: Sequence[int], coords: dict[str, int], sizes: dict[str, int], inputs: Tensors | None = None
    ) -> list[torch.Tensor]:
        """Per tensor dim, the global positions held by the rank at mesh `coords` (mesh dim sizes
        `sizes`), in local order.  Pure: the driver can map any rank's piece without a mesh."""
        ndim = len(full_shape)
        idx = [torch.arange(int(n)) for n in full_shape]
        for d, p in zip(MESH_DIMS, self.placements):
            n, r = sizes.get(d, 1), coords.get(d, 0)
            if isinstance(p, Shard):
                dim = p.dim % ndim
                size, offset = Shard.local_shard_size_and_offset(len(idx[dim]), n, r)
                idx[dim] = idx[dim][offset : offset + size]
            elif isinstance(p, IndexRule) and n > 1:
                dim = p.dim % ndim
                idx[dim] = idx[dim][p.positions(len(idx[dim]), n, r, inputs or {})]
        return idx

    def mesh_indices(
        self, full_shape: Sequence[int], mesh: DeviceMesh, inputs: Tensors | None = None
    ) -> list[torch.Tensor]:
        dims = mesh_dims(mesh)
        return self.indices(full_shape, dims.coords, dims.sizes, inputs)

    def misfit(
        self,
        full_shape: Sequence[int],
        sizes: dict[str, int],
        inputs: Tensors | None = None,
        empty_pieces: Sequence[str] = (),
    ) -> str:
        """Why this layout cannot lay a tensor of `full_shape` out over a mesh of `sizes`, or "" where it can: an
        index rule the length does not split for (head-tail needs a multiple of 2·CP), or a Shard over a mesh dim
        not in `empty_pieces` leaving some rank an empty piece (a dim smaller than the mesh dim).  Pure, like
        `indices`."""
        # The first and the last rank: torch's Shard gives the last ranks the smallest pieces, and an index rule
        # that cannot split a length fails on every rank.
        for corner in ({d: 0 for d in MESH_DIMS}, {d: sizes.get(d, 1) - 1 for d in MESH_DIMS}):
            try:
                idx = self.indices(full_shape, corner, sizes, inputs)
            except (ValueError, KeyError, IndexError, RuntimeError) as exc:
                return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            for d, p in zip(MESH_DIMS, self.placements):
                dim = p.dim % len(full_shape) if isinstance(p, Shard) and full_shape else None
                if dim is not None and d not in empty_pieces and sizes.get(d, 1) > 1 and len(idx[dim]) == 0:
                    return (
                        f"dim {dim} of length {full_shape[dim]} sharded over {d}={sizes[d]} leaves some ranks an "
                        "empty piece, and the case does not test empty pieces"
                    )
        return ""

    def reduce_partial(self, local: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        """Sum the local values over the Partial dims (a no-op without any), in float64 so the
        harness's own sum adds no rounding to what is judged."""
        if not any(isinstance(p, Partial) for p in self.placements):
            return local
        dims = mesh_dims(mesh)
        group_dims = [d for d, p in zip(MESH_DIMS, self.placements) if isinstance(p, Partial) and dims.sizes[d] > 1]
        total = local.detach().to(torch.float64, copy=True)  # never the op's own output: all_reduce is in place
        for d in group_dims:
            torch.distributed.all_reduce(total, group=dims.groups[d])
        return total

    def local(self, full: torch.Tensor, mesh: DeviceMesh, inputs: Tensors | None = None) -> torch.Tensor:
        """This rank's piece of `full` (no communication: every rank holds the same full tensor)."""
        return take(full, self.mesh_indices(full.shape, mesh, inputs))

    def global_index(
        self, local_index: Sequence[int], full_shape: Sequence[int], mesh: DeviceMesh, inputs: Tensors | None = None
    ) -> tuple[int, ...]:
        idx = self.mesh_indices(full_shape, mesh, inputs)
        return tuple(int(ix[i]) for ix, i in zip(idx, local_index))

    def local_range(self, full_shape: Sequence[int], dim: int, mesh: DeviceMesh) -> tuple[int, int]:
        """[start, end) of this rank's piece along `dim` in global coordinates (a contiguous piece)."""
        dim %= len(full_shape)
        placements = [Shard(p.dim % len(full_shape)) if isinstance(p, Shard) else Replicate() for p in self.placements]
        if any(isinstance(p, IndexRule) and p.dim % len(full_shape) == dim for p in self.placements):
            ix = self.mesh_indices(full_shape, mesh)[dim]
            if len(ix) and not torch.equal(ix, torch.arange(int(ix[0]), int(ix[0]) + len(ix))):
                raise ValueError(f"dim {dim} of {self} is not a contiguous range on this rank")
            return (int(ix[0]), int(ix[0]) + len(ix)) if len(ix) else (0, 0)
        shape, offset = compute_local_shape_and_global_offset(torch.Size(full_shape), mesh, placements)
        return int(offset[dim]), int(offset[dim]) + int(shape[dim])


def take(full: torch.Tensor, indices: Sequence[torch.Tensor]) -> torch.Tensor:
    """full restricted to the given positions per dim (a copy only where a dim is not whole)."""
    out = full
    for d, ix in enumerate(indices):
        if len(ix) != full.shape[d] or not torch.equal(ix, torch.arange(full.shape[d])):
            out = out.index_select(d, ix.to(out.device))
    return out


REPLICATED = Layout()


class GradSum(torch.autograd.Function):
    """Identity whose backward sums the gradient over each of `groups`: a DDP stand-in for a tensor
    replicated over mesh dims whose ranks each see only their own summand of the loss (a parameter
    under DP, a weight used by every CP rank on its own tokens).  `GradSum.apply(x, (dp_group, ...))`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, groups) -> torch.Tensor:
        ctx.groups = groups
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        # A fresh contiguous buffer: g may be a strided view, and a collective on a non-contiguous
        # tensor reduces the wrong elements.  fp32 or better: no rounding of our own.
        total = g.contiguous().to(torch.promote_types(g.dtype, torch.float32), copy=True)
        for group in ctx.groups:
            if torch.distributed.get_world_size(group) > 1:
                torch.distributed.all_reduce(total, group=group)
        return total.to(g.dtype), None


def as_tuple(out) -> tuple:
    """An op's result as a tuple of outputs."""
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def is_float(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


class RuleSource(enum.StrEnum):
    """Where a check's rule comes from: the seed's API docs, or a choice of ours that docs/ops states."""

    SEED = "seed"  # the seed says so: a quoted sentence, or its signature
    OURS = "ours"  # the seed leaves it open; docs/ops/<family>.md#<section> fixes it


@dataclass(frozen=True)
class Rule:
    """Where the rule a check enforces comes from (`source`) and where it is written (`cite`): for the seed a quoted
    sentence or the signature, for ours the docs/ops section ("docs/ops/model_utils.md#log-probs-of-a-target").  Under
    `--impl`, a failure of a rule that is ours alone is a `warn` naming it, unless it is a silent wrong answer."""

    source: RuleSource
    cite: str

    def __post_init__(self):
        object.__setattr__(self, "source", RuleSource(self.source))
        if not self.cite.strip():
            raise ValueError("a Rule cites where it is written (a seed sentence or a docs/ops section)")
        if self.source == RuleSource.OURS and "#" not in self.cite:  # a suite of someone else's cites its own docs
            raise ValueError(
                f"a rule of ours cites the section that states it (docs/ops/<family>.md#<anchor>), got {self.cite!r}"
            )

    def __str__(self) -> str:
        return f"rule: ours, {self.cite}" if self.source == RuleSource.OURS else f"rule: seed: {self.cite}"


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


def seed(cite: str) -> Rule:
    """A rule the seed states: `cite` quotes its sentence or names its signature."""
    return Rule(RuleSource.SEED, cite)


def ours(cite: str) -> Rule:
    """A rule of ours: `cite` is its docs/ops section, docs/ops/<family>.md#<anchor>."""
    return Rule(RuleSource.OURS, cite)


# The standard value and gradient checks: the op's documented result, on the inputs the seed describes.
DOCUMENTED_RESULT = seed("the op's documented result (its docstring and signature)")
# The harness's own checks.
COMM_RULE = ours("docs/ops/README.md#conventions-shared-by-every-family")  # the communication contract
SIGNATURE_RULE = seed("the seed's signature")
# float64 computed in float32, bfloat16 math: the precision each dtype computes in is ours to fix
PRECISION_RULE = ours("docs/ops/README.md#conventions-shared-by-every-family")


@dataclass
class Property:
    """Result of a `property:<name>` check on one rank.  `rule`: where the property's rule comes from (else the
    case's `rules` name it)."""

    name: str
    passed: bool
    value: float | None = None
    message: str = ""
    rule: Rule | None = None


BAD_INPUT_CHECK = "property:bad_input"


@dataclass(frozen=True)
class BadInput:
    """A case that feeds the op input outside its contract, judged "loud or right".

    The op passes when it raises (any exception: its type is recorded), or, where the case names a
    documented `interpretation` of the input, when it returns the answer of that interpretation: the
    case's reference computes it, and outputs and gradients are compared as in any case (the
    `forward` / `grad:` rows then stand for the case).  It fails on a silent return where no
    interpretation exists, on a wrong answer, a hang or a dead rank.  `documented`: the exception
    types the seed documents for this input; raising another type is then a `warn`."""

    what: str  # the input outside the contract, in words
    interpretation: str | None = None  # the documented reading a returned answer is judged by
    documented: tuple[type[BaseException], ...] = ()
    # Whose rule says this input is outside the contract: the seed's (it states the shapes, or documents the error) or
    # ours ("loud or right" where the seed does not say what the op does with it).
    rule: Rule | None = None

    def judge_raise(self, exc: BaseException) -> tuple[str, str]:
        """(status, message) of the op raising `exc` on this input."""
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        raised = f"raised {type(exc).__name__}" + (f": {first}" if first else "")
        if self.documented and not isinstance(exc, self.documented):
            names = " or ".join(t.__name__ for t in self.documented)
            return Status.WARN, f"{raised}; the seed documents {names} for {self.what}"
        return Status.PASS, raised

    def silent_return(self) -> str:
        """The message of a silent return where no interpretation exists."""
        return (
            f"returned without an exception on {self.what}, for which no answer is documented: "
            "the op must raise instead of returning silently"
        )


@dataclass
class RankContext:
    """What `Case.run` (and a case's properties, comm contract and output checks) may ask about the rank it
    runs on: the mesh and its groups (`group("tp")`, `rank("tp")`, `size("tp")`), the topology, the dtype the
    inputs come in, the case's `params`, and the full shape and range of each input's local piece."""

    mesh: DeviceMesh
    topology: Topology
    device: torch.device
    dtype: torch.dtype
    full_shapes: dict[str, tuple[int, ...]]
    input_layouts: dict[str, Layout]
    impl: ModuleType | None = None  # the module under test, for properties that call the op again
    full_inputs: Tensors | None = None  # the full inputs (what index rules such as PackedHeadTail read)
    params: dict = field(default_factory=dict)  # the case's params: a run shared by many cases reads its own here
    # What a run keeps open until its item's backward has run (`keep_open`); the harness closes it.
    contexts: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    kept_open: bool = False
    # {family: its module under test} of the families the case `uses` (resolved as each family's own suite's)
    modules: dict[str, Any] = field(default_factory=dict)
    # Where a run makes its outputs one at a time (a model case's hooks), it may hand each one here as it comes:
    # judge_output(name, local tensor, layout) is True when the harness judged it at once (the run then keeps
    # nothing of it and returns None in its place), False when the run must return it as usual.  None: no such
    # judge (a benchmark's run): the run returns every output.
    judge_output: Callable[[str, torch.Tensor, Layout], bool] | None = None

    def __post_init__(self):
        # Asked once, here: DeviceMesh builds tensors to find a coordinate, and a case's run asks inside
        # the op's memory measurement (whose peak would then grow with the launch's world size).
        dims = mesh_dims(self.mesh)
        self._groups, self._ranks, self._sizes = dict(dims.groups), dict(dims.coords), dict(dims.sizes)

    def keep_open(self, context) -> Any:
        """Enter `context` and keep it open through the item's backward, as a training loop keeps its train
        context (CP) open through `loss.backward()`.  The harness then runs the backward right after the run,
        closes the context, and only then judges outputs and gradients, outside it."""
        self.kept_open = True
        return self.contexts.enter_context(context)

    def group(self, dim: str) -> torch.distributed.ProcessGroup:
        return self._groups[dim]

    def rank(self, dim: str) -> int:
        return self._ranks[dim]

    def size(self, dim: str) -> int:
        return self._sizes[dim]

    def local_shape(self, input_name: str) -> tuple[int, ...]:
        """Shape of this rank's piece of input `input_name` (CP index rules included)."""
        layout = self.input_layouts.get(input_name, REPLICATED)
        return tuple(len(ix) for ix in layout.mesh_indices(self.full_shapes[input_name], self.mesh, self.full_inputs))

    def local_range(self, input_name: str, dim: int) -> tuple[int, int]:
        """Global [start, end) of this rank's piece of input `input_name` along `dim`."""
        return self.input_layouts[input_name].local_range(self.full_shapes[input_name], dim, self.mesh)

    def coords(self) -> dict[str, int]:
        return dict(self._ranks)

    def module(self, family: str) -> Any:
        """Another family's module under test, resolved as that family's own suite resolves it: `--impl
        FAMILY=SPEC`, else its default (`shardcheck.distributed_impl.<family>`).  The case names it in `uses`."""
        if family not in self.modules:
            raise KeyError(f"family {family!r} is not among the case's uses={tuple(self.modules)}: add it there")
        return self.modules[family]


# run(impl_module, ctx, local_inputs) -> output tensor or tuple of output tensors
RunFn = Callable[[ModuleType, RankContext, Tensors], Any]
# properties(ctx, full_inputs, local_inputs, local_outputs) -> list of Property
PropertiesFn = Callable[[RankContext, Tensors, Tensors, tuple], list[Property]]
# comparator for one output: (got_local, golden_local, full_inputs, local_inputs, ctx) -> (passed, message)
OutputCheck = Callable[[torch.Tensor, torch.Tensor, Tensors, Tensors, RankContext], tuple[bool, str]]


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

    # ---- where it runs
    dtypes: tuple[str, ...] = ("float64", "float32", "bfloat16")
    supports: Callable[[Topology], bool] = lambda topology: True
    # Whether the case exercises the CP axis.  None: derived from the layouts (something is
    # sharded over "cp", or the outputs are summands over it).  A case that does not would run
    # the same computation on every CP rank, so topologies with cp > 1 skip it.  Ops that shard
    # over CP by themselves (full inputs in, e.g. cp_utils' context) say True.
    context_parallel: bool | None = None
    # The op communicates over the default (world) process group rather than the mesh's groups (e.g.
    # inbatch_neg_utils' gathers): each topology then runs only in a launch whose world size equals
    # its size, so no spare rank is missing from the op's collectives; a topology whose size is not
    # one of the launched world sizes is skipped for this case.
    world_group: bool = False
    # The mesh dims over which the case tests pieces that are empty on some ranks (a Shard over a dim smaller than
    # the mesh dim: V < TP, or V = 33 at TP 8, whose last rank gets nothing): ("tp",) where the op supports a rank
    # holding no vocab entries.  Elsewhere the plan skips, with the reason, a topology at which an input would
    # leave a rank an empty piece (Case.misfit).
    empty_pieces: tuple[str, ...] = ()
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
        if not set(self.summed_over) <= set(MESH_DIMS):
            raise ValueError(f"{where}: summed_over {self.summed_over} names a dim outside {MESH_DIMS}")
        for name, layout in [*self.input_layouts.items(), *zip(self.output_names, self.output_layouts)]:
            if not isinstance(layout, Layout):
                raise ValueError(
                    f"{where}: the layout of {name!r} is {layout!r}; expected a Layout, e.g. Layout(tp=Shard(-1))"
                )

    def rule_of(self, check: str, prop: Property | None = None) -> Rule | None:
        """Where the rule of `check` comes from (None: nobody cited it, a suite of someone else's)."""
        if prop is not None and prop.rule is not None:
            return prop.rule
        if check == BAD_INPUT_CHECK and self.bad_input is not None and self.bad_input.rule is not None:
            return self.bad_input.rule
        if check == "property:comm":  # the harness's own checks, whatever a suite's catch-all pattern says
            return COMM_RULE
        if check == SIGNATURE_CHECK:
            return SIGNATURE_RULE
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
        return self.supports(topology)

    def misfit(self, topology: Topology, inputs: Tensors) -> str:
        """Why the case's full `inputs` cannot be laid out at `topology` (the first input that cannot, in words), or
        "" where they can: what the plan records as the item's skip reason instead of running it."""
        sizes = {"dp": topology.dp, "cp": topology.cp, "tp": topology.tp}
        for length in self.cp_lengths:
            if topology.cp > 1 and length % (2 * topology.cp):
                return (
                    f"a sequence of {length} cannot be split head-tail at {topology}: the op needs a multiple of "
                    f"2·CP = {2 * topology.cp}"
                )
        for name, layout in self.input_layouts.items():
            if name in inputs and layout is not REPLICATED:
                why = layout.misfit(tuple(inputs[name].shape), sizes, inputs, self.empty_pieces)
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


# ------------------------------------------------------------------------------------------- memory model


@dataclass(frozen=True)
class MemoryModel:
    """What one rank's forward and backward should allocate, from the shapes (`Case.memory`).

    `peak_bytes`: the expected peak above what existed before the step (the inputs do not count; the gradients
    the step produces do), as the CPU tracker and CUDA's allocator measure it.  `saved_bytes`: what the forward
    saves for the backward beyond its inputs.  `terms`: how the peak is made up, in words (for the report)."""

    peak_bytes: int
    saved_bytes: int = 0
    terms: str = ""


# ------------------------------------------------------------------------------------------- known failures


@dataclass(frozen=True)
class KnownFailure:
    """A defect of the code under test that is known and tracked elsewhere (`reference`: an upstream issue).

    Per item, the checks it covers (`checks`: fnmatch patterns over check names, "grad:*", "forward") that fail
    or error on some rank are recorded `xfail`, the finding kept in the row's message, and the covered checks
    passing beside them stay `pass` (the defect is still there); once every covered check of the item passes on
    every rank they are `xpass`, which fails the run so that the fix is noticed and the mark removed.
    `when(topology, dtype_name)` limits it to part of the matrix (None: everywhere); a range of a case's
    parameters is marked by setting it only on the cases whose parameters are in the range."""

    reason: str
    reference: str = ""
    checks: tuple[str, ...] = ("*",)
    when: Callable[[Topology, str], bool] | None = None

    def __post_init__(self):
        if not isinstance(self.reason, str) or not self.reason.strip():
            raise ValueError("KnownFailure needs a reason (what fails, in words)")
        checks = (self.checks,) if isinstance(self.checks, str) else tuple(self.checks)  # "grad:*" alone is one pattern
        if not checks or not all(isinstance(c, str) and c for c in checks):
            raise ValueError(f"KnownFailure checks must be non-empty check-name patterns, got {self.checks!r}")
        object.__setattr__(self, "checks", checks)

    def applies(self, topology: Topology, dtype: str) -> bool:
        """Whether it marks the item of this topology and dtype."""
        return self.when is None or bool(self.when(topology, dtype))


# ------------------------------------------------------------------------------------------- fuzz spaces


@dataclass(frozen=True)
class FuzzSpace:
    """The space `shardcheck fuzz` draws one op's cases from (a suite's `fuzz_spaces()` lists them).

    `params(topologies)` is a hypothesis strategy of JSON-able dicts; `topologies` are those the run allows
    (`--topology`, the launched world sizes), and the strategy draws the case's own from the legal ones.  Each dict
    holds "topology": [dp, cp, tp] and "dtype": a dtype name, beside the case's own parameters (sizes, chunking,
    masking ratios, which special values, ...).  `case(params)` builds the ordinary Case those parameters
    describe; every rank rebuilds it from the same dict, so it must be a pure function of it.  The harness gives
    the case its id, its one dtype and its one topology (harness/rank/fuzz_cases.py)."""

    op: str
    params: Callable[[list[Topology]], Any]  # -> hypothesis SearchStrategy[dict]
    case: Callable[[dict], Case]
