"""Suite for nemo_automodel.components.models.common.inbatch_neg_utils: in-batch negatives across DP ranks.

These functions gather over the *default* process group, so every case that calls a gather is
`world_group`: it runs at (dp, 1, 1) only, in a launch of exactly dp ranks, where the world
group is the DP group (in a larger launch the spare ranks would be missing from the gather).

- The main cases (op `dist_gather_tensor`, ids `step-*`) are a bi-encoder contrastive step: a
  linear encoder on each DP rank's queries and passages, passages gathered with
  `dist_gather_tensor(..., preserve_grad=...)`, doc ids gathered, scores, duplicates of each
  positive masked, cross entropy against the positive column, summed / the global batch. The loss
  is `Partial` over DP (the DP ranks' losses add up to the global mean) and the encoder's weight and
  bias go through a DDP stand-in that sums their gradients over DP, so loss and every gradient
  (weight, bias, query and passage features) must equal the same step on one device over the global
  batch. With `preserve_grad=False` the loss is the same and the gradients are the documented
  local-only ones, from a reference of their own at each DP size (`step-*-local-only-dp<N>`).
- Direct cases: the gathers on None, on a world of 1 (t itself comes back), on int ids, on float
  tensors (autograd-aware: each rank's gathered output is its own loss summand; local-only: the
  local slice gets this rank's gradient and nothing else); the dim-1 padding with per-rank dim-1
  sizes and a non-zero `padding_value` (float, bool, int); the mask on every rank's rows (bf16,
  fp32, fp64 scores), the positive never masked; bad arguments raise (float doc ids may instead be
  compared as numbers: the mask must then be the one of the same ids as int64).
Every case declares its exact collectives (`property:comm`); on the world group they are counted
under `@dp` (the mesh's DP group *is* the world group there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardcheck import (
    REPLICATED,
    BadInput,
    Case,
    FuzzSpace,
    GradSum,
    Layout,
    Partial,
    Property,
    Shard,
    cite,
    ours,
    seed,
)
from shardcheck.reference import inbatch_neg_utils as ref
from shardcheck.suites._fuzz_draws import topology as fuzz_topology

FAMILY = "inbatch_neg_utils"
OP = FAMILY + "."
GATHER = OP + "dist_gather_tensor"
GATHER_PADDED = OP + "dist_gather_tensor_with_dim1_padding"
MASK = OP + "mask_gathered_passages_same_doc_as_positive"

ROWS = Layout(dp=Shard(0))  # [B, ...] (or [B·n, ...] passages): each DP rank holds its own rows
LOSS = Layout(dp=Partial())  # scalar: the global loss is the sum of the DP ranks' losses
NO_COMM = lambda ctx: {"forward": {}, "backward": {}}  # noqa: E731
AG, AR, RS = "all_gather@dp", "all_reduce@dp", "reduce_scatter@dp"


def _dp_only(topology) -> bool:
    return topology.cp == 1 and topology.tp == 1


def _dp_divides(b: int):
    return lambda t: _dp_only(t) and b % t.dp == 0


# ---- inputs -------------------------------------------------------------------------------


def make_doc_ids(gen: torch.Generator, b: int, n: int) -> torch.Tensor:
    """Doc ids [b·n] of the passages (query i's positive at i·n, its negatives after it), distinct except
    for duplicates placed on purpose, across ranks at every DP size that divides b (b >= 4):
    - queries 0 and b−1 share their positive (first and last DP rank);
    - with n > 1: query 2's positive is a negative of query 0 (rank 0 sees a remote duplicate at dp 4),
      query 1's positive a negative of query b−1 (last rank), query 2's positive again among its own
      negatives, and two negatives of query 1 are one doc that is no positive (never masked)."""
    ids = torch.randperm(10 * b * n, generator=gen)[: b * n] + 100
    ids[(b - 1) * n] = ids[0]
    if n > 1:
        ids[1] = ids[2 * n]
        ids[(b - 1) * n + 2] = ids[n]
        ids[2 * n + n - 1] = ids[2 * n]
        ids[n + 3 if n > 3 else n + 1] = ids[n + 2 if n > 3 else n + 1]
    return ids


def random_doc_ids(gen: torch.Generator, b: int, n: int, duplicates: float) -> torch.Tensor:
    """Doc ids [b·n] for any b and n: distinct, then each passage after the first, with probability `duplicates`,
    the doc of a random passage (any rank's, a positive or a negative; 1.0: everything one doc)."""
    ids = torch.randperm(10 * b * n, generator=gen)[: b * n] + 100
    for j in range(1, b * n):
        if float(torch.rand((), generator=gen)) < duplicates:
            ids[j] = ids[int(torch.randint(0, j, (), generator=gen))]
    return ids


def make_passage_features(gen: torch.Generator, doc_ids: torch.Tensor, d_in: int) -> torch.Tensor:
    """Features [b·n, d_in]; passages with the same doc id get the same features (a duplicate doc is the
    same text: tied scores)."""
    feats = torch.randn((doc_ids.numel(), d_in), generator=gen, dtype=torch.float64)
    first = {}
    for j, doc in enumerate(doc_ids.tolist()):
        feats[j] = feats[first.setdefault(doc, j)]
    return feats


# ---- the contrastive step (op dist_gather_tensor, ids step-*) -------------------------------


@dataclass(frozen=True)
class Step:
    n: int  # train_n_passages: 1 positive + n−1 negatives per query
    preserve_grad: bool = True
    dp: int | None = None  # preserve_grad=False: the DP size whose local-only gradient the reference gives
    b: int = 4  # global batch (queries)
    d_in: int = 6
    d_out: int = 5
    temperature: float = 0.5
    duplicates: float | None = None  # None: make_doc_ids' placed duplicates (b >= 4); else random_doc_ids'

    @property
    def case_id(self) -> str:
        mode = "preserve" if self.preserve_grad else f"local-only-dp{self.dp}"
        dup = "" if self.duplicates is None else f"-dup{self.duplicates:g}"
        return f"step-b{self.b}n{self.n}-d{self.d_in}x{self.d_out}-T{self.temperature:g}{dup}-{mode}"

    @property
    def params(self) -> dict:
        return {
            "B": self.b,
            "train_n_passages": self.n,
            "d_in": self.d_in,
            "d_out": self.d_out,
            "temperature": self.temperature,
            "preserve_grad": self.preserve_grad,
            "local_only_dp": self.dp,
            **({} if self.duplicates is None else {"duplicates": self.duplicates}),
        }


def _step_inputs(step: Step):
    def make(gen: torch.Generator) -> dict[str, torch.Tensor]:
        doc_ids = (
            make_doc_ids(gen, step.b, step.n)
            if step.duplicates is None
            else random_doc_ids(gen, step.b, step.n, step.duplicates)
        )
        return {
            "query_features": torch.randn((step.b, step.d_in), generator=gen, dtype=torch.float64),
            "passage_features": make_passage_features(gen, doc_ids, step.d_in),
            "passage_doc_ids": doc_ids,
            "weight": torch.randn((step.d_out, step.d_in), generator=gen, dtype=torch.float64) * 0.5,
            "bias": torch.randn((step.d_out,), generator=gen, dtype=torch.float64) * 0.1,
        }

    return make


def _step_reference(step: Step):
    def reference(x):
        args = (
            x["query_features"],
            x["passage_features"],
            x["passage_doc_ids"],
            x["weight"],
            x["bias"],
            step.n,
            step.temperature,
        )
        if step.preserve_grad:
            return ref.contrastive_loss(*args)
        return ref.contrastive_loss_local_only(*args, dp=step.dp)

    return reference


def _step_run(step: Step):
    def run(impl, ctx, x):
        rank, dp_group = ctx.rank("dp"), ctx.group("dp")
        weight = GradSum.apply(x["weight"], (dp_group,))
        bias = GradSum.apply(x["bias"], (dp_group,))
        queries = F.linear(x["query_features"], weight, bias)  # [b_local, d_out]
        passages = F.linear(x["passage_features"], weight, bias)  # [b_local·n, d_out]
        all_passages = impl.dist_gather_tensor(passages, preserve_grad=step.preserve_grad)  # [B·n, d_out]
        all_doc_ids = impl.dist_gather_tensor(x["passage_doc_ids"])
        scores = queries @ all_passages.T / step.temperature
        b_local = queries.shape[0]
        impl.mask_gathered_passages_same_doc_as_positive(scores, all_doc_ids, step.n, rank, b_local)
        targets = (rank * b_local + torch.arange(b_local, device=scores.device)) * step.n
        # the loss in float32 at least, as a trainer computes it (the reference does the same)
        rows = F.cross_entropy(scores.to(torch.promote_types(scores.dtype, torch.float32)), targets, reduction="none")
        return rows.sum() / ctx.full_shapes["query_features"][0]  # this rank's summand of the global mean

    return run


def step_comm(step: Step):
    """Per rank, at dp = world > 1 (P = b_local·n passages, e = bytes of the dtype, e32 = float32 at least):
      forward  all_gather@dp: 2 calls, P·d_out·e (passage embeddings) + P·8 (int64 doc ids);
      backward preserve_grad: reduce_scatter@dp 1 call of the whole [B·n, d_out] embedding gradient,
               dp·P·d_out·e (each slice summed over the ranks' losses and sent to its owner);
               local-only: nothing of the op's own;
               plus the DDP stand-in: all_reduce@dp, 2 calls, (d_out·d_in + d_out)·e32.
    Lower bound: every rank must receive every passage embedding (and its doc id) to score against it,
    and with preserve_grad every remote slice's gradient must reach its owner: one reduce-scatter;
    nothing of size B·n·d_out moves in the local-only backward. dp = 1: no collective at all."""

    def comm(ctx) -> dict:
        dp = ctx.size("dp")
        if dp == 1:
            return {"forward": {}, "backward": {}}
        p = step.b // dp * step.n
        e, e32 = ctx.dtype.itemsize, torch.promote_types(ctx.dtype, torch.float32).itemsize
        backward = {AR: (2, (step.d_out * step.d_in + step.d_out) * e32)}
        if step.preserve_grad:
            backward[RS] = (1, dp * p * step.d_out * e)
        return {"forward": {AG: (2, p * step.d_out * e + p * 8)}, "backward": backward}

    return comm


def step_case(step: Step) -> Case:
    if step.preserve_grad:
        supports = _dp_divides(step.b)
    else:
        supports = lambda t, dp=step.dp: _dp_only(t) and t.dp == dp  # noqa: E731  (its reference is per DP size)
    return Case(
        op=GATHER,
        case_id=step.case_id,
        params=step.params,
        make_inputs=_step_inputs(step),
        reference=_step_reference(step),
        run=_step_run(step),
        input_layouts={"query_features": ROWS, "passage_features": ROWS, "passage_doc_ids": ROWS},
        output_layouts=(LOSS,),
        output_names=("loss",),
        grad_inputs=("weight", "bias", "query_features", "passage_features"),
        comm=step_comm(step),
        supports=supports,
        world_group=True,
    )


# ---- exact checks -------------------------------------------------------------------------


def _first_difference(got: torch.Tensor, expected: torch.Tensor, offset: tuple[int, ...] = ()) -> str:
    diff = got.cpu() != expected.cpu()
    if got.is_floating_point():
        diff &= ~(torch.isnan(got.cpu()) & torch.isnan(expected.cpu()))
    where = tuple(int(i) for i in diff.nonzero()[0])
    at = tuple(w + (offset[k] if k < len(offset) else 0) for k, w in enumerate(where))
    return (
        f"{int(diff.sum())} element(s) differ, first at global {at}: expected {expected[where].item()}, "
        f"got {got[where].item()}"
    )


def exact_check(got, expected, full, local, ctx) -> tuple[bool, str]:
    """got == the golden exactly, dtype included (gathers of ids and masks are copies)."""
    if not isinstance(got, torch.Tensor):
        return False, f"got {type(got).__name__}, expected a tensor"
    if got.dtype != expected.dtype or got.shape != expected.shape:
        return (
            False,
            f"got {str(got.dtype)[6:]} {tuple(got.shape)}, expected {str(expected.dtype)[6:]} {tuple(expected.shape)}",
        )
    if torch.equal(got.cpu(), expected.cpu()):
        return True, "equal"
    return False, _first_difference(got, expected)


# ---- direct cases of dist_gather_tensor ---------------------------------------------------


def _gather_comm(name: str, grad: bool = False, fixed_dtype: torch.dtype | None = None):
    """One all_gather@dp of this rank's piece of input `name` (dp > 1); preserve_grad with grad: one
    reduce_scatter@dp of the whole gathered gradient. Lower bound: the gather itself."""

    def comm(ctx) -> dict:
        dp = ctx.size("dp")
        if dp == 1:
            return {"forward": {}, "backward": {}}
        numel = 1
        for a, b in (ctx.local_range(name, d) for d in range(len(ctx.full_shapes[name]))):
            numel *= b - a
        e = (fixed_dtype or ctx.dtype).itemsize
        return {"forward": {AG: (1, numel * e)}, "backward": {RS: (1, dp * numel * e)} if grad else {}}

    return comm


def _unchanged_properties(ctx, full, local, outs):
    """A world of 1: the very tensor passed in comes back, with and without preserve_grad."""
    props = []
    for name, (got, given) in outs[0].items():
        props.append(
            Property(
                f"unchanged:{name}",
                got is given,
                None,
                "t itself" if got is given else f"got a new {type(got).__name__}, expected t itself",
            )
        )
    return props


def _world1_run(impl, ctx, x):
    t = x["t"].clone().requires_grad_()
    return {
        "float": (impl.dist_gather_tensor(x["t"]), x["t"]),
        "float-requires-grad": (impl.dist_gather_tensor(t, preserve_grad=False), t),
        "float-requires-grad-preserve": (impl.dist_gather_tensor(t, preserve_grad=True), t),
        "ids": (impl.dist_gather_tensor(x["ids"], preserve_grad=True), x["ids"]),
        "dim1-padding": (impl.dist_gather_tensor_with_dim1_padding(t, padding_value=-1.0, preserve_grad=True), t),
    }


def _no_grad_property(ctx, full, local, outs):
    got = outs[0]
    return [
        Property(
            "detached",
            not got.requires_grad,
            None,
            "no autograd on a gather of a tensor without grad"
            if not got.requires_grad
            else "the gather of a tensor without grad requires grad",
        )
    ]


def gather_cases(b: int = 4, h: int = 3) -> list[Case]:
    common = dict(op=GATHER, supports=_dp_divides(b), world_group=True)
    floats = lambda gen: {"t": torch.randn((b, h), generator=gen, dtype=torch.float64)}  # noqa: E731
    ids = lambda gen: {"t": torch.randperm(1000, generator=gen)[:b] + 7}  # noqa: E731
    scalar = lambda gen: {"t": torch.randn((), generator=gen, dtype=torch.float64)}  # noqa: E731
    cases = [
        Case(
            case_id="none",
            params={"t": None},
            make_inputs=lambda gen: {},
            reference=lambda x: (None, None),
            run=lambda impl, ctx, x: (impl.dist_gather_tensor(None), impl.dist_gather_tensor(None, preserve_grad=True)),
            output_layouts=(REPLICATED, REPLICATED),
            output_names=("plain", "preserve_grad"),
            dtypes=("float64",),
            comm=NO_COMM,
            **common,
        ),
        Case(
            case_id=f"ids-int64-b{b}",
            params={"B": b, "dtype": "int64"},
            make_inputs=ids,
            reference=lambda x: x["t"],
            run=lambda impl, ctx, x: impl.dist_gather_tensor(x["t"], preserve_grad=True),
            input_layouts={"t": ROWS},
            output_checks={"out": exact_check},
            dtypes=("float64",),
            comm=_gather_comm("t", fixed_dtype=torch.int64),
            **common,
        ),
        # Autograd-aware: every rank's gathered copy feeds its own loss (summed_over dp); rank r's slice
        # must get the sum of all ranks' gradients for it.
        Case(
            case_id=f"float-b{b}h{h}-preserve",
            params={"B": b, "H": h, "preserve_grad": True},
            make_inputs=floats,
            reference=lambda x: x["t"].clone(),
            input_layouts={"t": ROWS},
            grad_inputs=("t",),
            summed_over=("dp",),
            run=lambda impl, ctx, x: impl.dist_gather_tensor(x["t"], preserve_grad=True),
            comm=_gather_comm("t", grad=True),
            **common,
        ),
        # Local-only: the same upstream gradient on every rank (a replicated output); the local slice is t
        # itself, so rank r's gradient is exactly its slice of it, once (not dp times, not zero).
        Case(
            case_id=f"float-b{b}h{h}-local-only",
            params={"B": b, "H": h, "preserve_grad": False},
            make_inputs=floats,
            reference=lambda x: x["t"].clone(),
            input_layouts={"t": ROWS},
            grad_inputs=("t",),
            run=lambda impl, ctx, x: impl.dist_gather_tensor(x["t"]),
            comm=_gather_comm("t"),
            **common,
        ),
        Case(
            case_id=f"float-b{b}h{h}-no-grad",
            params={"B": b, "H": h, "requires_grad": False},
            make_inputs=floats,
            reference=lambda x: x["t"].clone(),
            input_layouts={"t": ROWS},
            properties=_no_grad_property,
            run=lambda impl, ctx, x: impl.dist_gather_tensor(x["t"], preserve_grad=True),
            comm=_gather_comm("t"),
            **common,
        ),
        # A world of 1: t itself comes back (a tensor that requires grad too). Properties only.
        Case(
            case_id="world1-unchanged",
            params={"world_size": 1},
            make_inputs=lambda gen: {**floats(gen), "ids": ids(gen)["t"]},
            reference=lambda x: (),
            run=_world1_run,
            output_layouts=(),
            output_names=(),
            properties=_unchanged_properties,
            dtypes=("float64",),
            op=GATHER,
            supports=lambda t: t.size == 1,
            world_group=True,
        ),
        # A 0-d tensor has no dim 0 to gather along: loud, at world size ≥ 2.  At world size 1 the seed says what the
        # op does ("Returns t unchanged when ... world size is 1"), so returning it is right there, and so is raising.
        Case(
            case_id="scalar",
            params={"shape": []},
            make_inputs=scalar,
            reference=lambda x: (),
            run=lambda impl, ctx, x: impl.dist_gather_tensor(x["t"]),
            bad_input=BadInput("a 0-d tensor (the op gathers along dim 0)"),
            dtypes=("float64",),
            **{**common, "supports": lambda t: t.size > 1 and common["supports"](t)},
        ),
        Case(
            case_id="scalar-world1",
            params={"shape": [], "world_size": 1},
            make_inputs=scalar,
            reference=lambda x: x["t"].clone(),
            run=lambda impl, ctx, x: impl.dist_gather_tensor(x["t"]),
            bad_input=BadInput(
                "a 0-d tensor (the op gathers along dim 0)", interpretation="world size 1: t unchanged (the seed)"
            ),
            dtypes=("float64",),
            **{**common, "supports": lambda t: t.size == 1},
        ),
    ]
    return cases


# ---- dist_gather_tensor_with_dim1_padding -------------------------------------------------


@dataclass(frozen=True)
class Padded:
    kind: str  # "float" | "bool" | "int64"
    lengths: tuple[int, ...]  # dim-1 length of each row; a rank's dim 1 is the longest of its rows
    padding_value: float | bool | int
    preserve_grad: bool = False
    h: int = 0  # > 0: a trailing feature dim [B, L, h]

    @property
    def case_id(self) -> str:
        shape = f"b{len(self.lengths)}L{'.'.join(map(str, self.lengths))}" + (f"h{self.h}" if self.h else "")
        grad = "-preserve" if self.preserve_grad else ("-local-only" if self.kind == "float" else "")
        return f"{self.kind}-{shape}-pad{self.padding_value}{grad}"

    @property
    def params(self) -> dict:
        return {
            "kind": self.kind,
            "lengths": list(self.lengths),
            "padding_value": self.padding_value,
            "preserve_grad": self.preserve_grad,
            "H": self.h,
        }


def _padded_inputs(spec: Padded):
    def make(gen: torch.Generator) -> dict[str, torch.Tensor]:
        shape = (len(spec.lengths), max(spec.lengths)) + ((spec.h,) if spec.h else ())
        if spec.kind == "float":
            t = torch.randn(shape, generator=gen, dtype=torch.float64)
        elif spec.kind == "bool":
            t = torch.rand(shape, generator=gen) < 0.5
        else:
            t = torch.randint(0, 50, shape, generator=gen)
        return {"t": t, "lengths": torch.tensor(spec.lengths)}

    return make


def _pad_rows(t: torch.Tensor, lengths: torch.Tensor, padding_value, length: int) -> torch.Tensor:
    """Rows of t with positions from each row's length on set to padding_value, cut to `length` (what a
    collator gives a rank: its rows padded to its own longest). Differentiable in t."""
    pos = torch.arange(t.shape[1], device=t.device).view(1, -1, *([1] * (t.ndim - 2)))
    valid = pos < lengths.to(t.device).view(-1, 1, *([1] * (t.ndim - 2)))
    return torch.where(valid, t, torch.full_like(t, padding_value))[:, :length]


def _padded_reference(spec: Padded):
    def reference(x):
        # Each row is its own piece, cut to its own length: the gathered result is the same for any
        # split of the rows over ranks, since a rank's dim 1 beyond a row's length is padding anyway.
        pieces = [
            _pad_rows(x["t"][i : i + 1], x["lengths"][i : i + 1], spec.padding_value, int(x["lengths"][i]))
            for i in range(len(spec.lengths))
        ]
        return ref.gather_with_dim1_padding(pieces, spec.padding_value)

    return reference


def _padded_run(spec: Padded):
    def run(impl, ctx, x):
        local = _pad_rows(x["t"], x["lengths"], spec.padding_value, int(x["lengths"].max()))
        return impl.dist_gather_tensor_with_dim1_padding(
            local, padding_value=spec.padding_value, preserve_grad=spec.preserve_grad
        )

    return run


def padded_comm(spec: Padded):
    """dp > 1: one all_reduce@dp of the int64 dim-1 length (MAX, 8 B), one all_gather@dp of the padded
    [b_local, L, ...] piece; with preserve_grad one reduce_scatter@dp of the whole gathered gradient.
    Lower bound: the ranks must agree on L (a scalar) before gathering equal-sized pieces."""

    def comm(ctx) -> dict:
        dp = ctx.size("dp")
        if dp == 1:
            return {"forward": {}, "backward": {}}
        e = ctx.dtype.itemsize if spec.kind == "float" else {"bool": 1, "int64": 8}[spec.kind]
        piece = len(spec.lengths) // dp * max(spec.lengths) * max(spec.h, 1) * e
        backward = {RS: (1, dp * piece)} if spec.preserve_grad else {}
        return {"forward": {AR: (1, 8), AG: (1, piece)}, "backward": backward}

    return comm


def padded_case(spec: Padded) -> Case:
    is_float = spec.kind == "float"
    grad = dict(grad_inputs=("t",), summed_over=("dp",) if spec.preserve_grad else ()) if is_float else {}
    return Case(
        op=GATHER_PADDED,
        case_id=spec.case_id,
        params=spec.params,
        make_inputs=_padded_inputs(spec),
        reference=_padded_reference(spec),
        run=_padded_run(spec),
        input_layouts={"t": ROWS, "lengths": ROWS},
        output_checks={} if is_float else {"out": exact_check},
        dtypes=("float64", "float32", "bfloat16") if is_float else ("float64",),
        comm=padded_comm(spec),
        supports=_dp_divides(len(spec.lengths)),
        world_group=True,
        **grad,
    )


def padded_extra_cases() -> list[Case]:
    common = dict(op=GATHER_PADDED, dtypes=("float64",), supports=_dp_divides(2), world_group=True)
    return [
        Case(
            case_id="none",
            params={"t": None},
            make_inputs=lambda gen: {},
            reference=lambda x: None,
            run=lambda impl, ctx, x: impl.dist_gather_tensor_with_dim1_padding(None, padding_value=3),
            comm=NO_COMM,
            **common,
        ),
        Case(
            case_id="one-dim",
            params={"shape": [2]},
            make_inputs=lambda gen: {"t": torch.randn((2,), generator=gen, dtype=torch.float64)},
            reference=lambda x: (),
            run=lambda impl, ctx, x: impl.dist_gather_tensor_with_dim1_padding(x["t"]),
            bad_input=BadInput("a 1-D tensor (no dim 1 to pad)"),
            **common,
        ),
    ]


# ---- mask_gathered_passages_same_doc_as_positive ------------------------------------------


@dataclass(frozen=True)
class Mask:
    b: int  # global batch
    n: int  # train_n_passages
    all_same_doc: bool = False  # every passage is the same doc: all but the positive masked
    duplicates: float | None = None  # None: make_doc_ids' placed duplicates (b >= 4); else random_doc_ids'

    @property
    def case_id(self) -> str:
        dup = "" if self.duplicates is None else f"-dup{self.duplicates:g}"
        return f"b{self.b}n{self.n}" + ("-all-same-doc" if self.all_same_doc else "") + dup


def _mask_inputs(spec: Mask):
    def make(gen: torch.Generator) -> dict[str, torch.Tensor]:
        if spec.all_same_doc:
            ids = torch.full((spec.b * spec.n,), 42)
        elif spec.duplicates is None:
            ids = make_doc_ids(gen, spec.b, spec.n)
        else:
            ids = random_doc_ids(gen, spec.b, spec.n, spec.duplicates)
        scores = torch.randn((spec.b, spec.b * spec.n), generator=gen, dtype=torch.float64) * 3
        scores[:, 1::2] = scores[:, 0::2][:, : scores[:, 1::2].shape[1]]  # ties between neighbouring columns
        return {"scores": scores, "passage_doc_ids": ids}

    return make


def _mask_run(spec: Mask):
    def run(impl, ctx, x):
        scores = x["scores"].clone()  # the op is in place; the input is a leaf
        impl.mask_gathered_passages_same_doc_as_positive(
            scores, x["passage_doc_ids"], spec.n, ctx.rank("dp"), scores.shape[0]
        )
        return scores

    return run


def _mask_check(spec: Mask):
    """Exactly the reference's mask on the same (dtype-rounded) scores: finfo(dtype).min, not the golden's
    float64 one, on exactly the same positions; everything else untouched."""

    def check(got, expected, full, local, ctx):
        start, end = ctx.local_range("scores", 0)
        want = ref.masked_scores(full["scores"], full["passage_doc_ids"], spec.n, 0, spec.b)[start:end]
        if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or got.shape != want.shape:
            return (
                False,
                f"got {getattr(got, 'dtype', type(got))} {tuple(getattr(got, 'shape', ()))}, expected "
                f"{want.dtype} {tuple(want.shape)}",
            )
        if torch.equal(got.detach().cpu(), want):
            return True, f"{int((want == torch.finfo(want.dtype).min).sum())} position(s) masked, as the reference"
        return False, _first_difference(got.detach(), want, (start, 0))

    return check


def _positive_kept(spec: Mask):
    """property:positive_kept: each local row's positive column holds its input score."""

    def properties(ctx, full, local, outs):
        got = outs[0].detach().cpu()
        b_local = got.shape[0]
        rows = torch.arange(b_local)
        positives = (ctx.rank("dp") * b_local + rows) * spec.n
        kept = got[rows, positives] == local["scores"].detach().cpu()[rows, positives]
        bad = [int(positives[i]) for i in range(b_local) if not kept[i]]
        return [
            Property(
                "positive_kept",
                not bad,
                None,
                f"positive column(s) {bad} of this rank's rows changed" if bad else "every positive kept",
            )
        ]

    return properties


def mask_case(spec: Mask) -> Case:
    return Case(
        op=MASK,
        case_id=spec.case_id,
        params={
            "B": spec.b,
            "train_n_passages": spec.n,
            "all_same_doc": spec.all_same_doc,
            **({} if spec.duplicates is None else {"duplicates": spec.duplicates}),
        },
        make_inputs=_mask_inputs(spec),
        reference=lambda x: ref.masked_scores(x["scores"], x["passage_doc_ids"], spec.n, 0, spec.b),
        run=_mask_run(spec),
        input_layouts={"scores": ROWS},
        output_names=("scores",),
        output_layouts=(ROWS,),
        grad_inputs=("scores",),
        output_checks={"scores": _mask_check(spec)},
        properties=_positive_kept(spec),
        comm=NO_COMM,
        supports=_dp_divides(spec.b),
    )


def mask_bad_input_cases() -> list[Case]:
    def bad(case_id, what, scores_shape, ids, n, rank, b_local, interpretation=None):
        def run(impl, ctx, x):
            scores = x["scores"].clone()  # the op is in place
            impl.mask_gathered_passages_same_doc_as_positive(scores, x["ids"], n, rank, b_local)
            return scores

        # Doc ids equal as numbers are the same doc, whatever their dtype: the mask of the same ids as int64.
        answer = (
            dict(
                reference=lambda x: ref.masked_scores(x["scores"], x["ids"].long(), n, rank, b_local),
                output_names=("scores",),
                output_checks={"scores": exact_check},
            )
            if interpretation
            else dict(reference=lambda x: ())
        )
        return Case(
            op=MASK,
            case_id=case_id,
            params={
                "scores": list(scores_shape),
                "passage_doc_ids": list(ids.shape),
                "ids_dtype": str(ids.dtype)[6:],
                "train_n_passages": n,
                "rank": rank,
                "local_batch_size": b_local,
            },
            make_inputs=lambda gen: {
                "scores": torch.randn(scores_shape, generator=gen, dtype=torch.float64),
                "ids": ids,
            },
            bad_input=BadInput(what, interpretation),
            dtypes=("float64",),
            supports=lambda t: t.size == 1,
            run=run,
            **answer,
        )

    return [
        bad("bad-ids-length", "8 score columns and 6 doc ids", (2, 8), torch.arange(6), 4, 0, 2),
        bad("bad-local-batch-size", "2 score rows and local_batch_size 3", (2, 8), torch.arange(8), 4, 0, 3),
        # float doc ids with duplicates: query 0's positive (column 0) recurs at column 2, query 1's (4) at 5
        bad(
            "bad-float-ids",
            "float64 doc ids (the seed's are int64)",
            (2, 8),
            torch.tensor([0.0, 1.0, 0.0, 2.0, 3.0, 3.0, 1.0, 4.0], dtype=torch.float64),
            4,
            0,
            2,
            interpretation="ids equal as numbers are one doc: the mask of the same ids as int64",
        ),
        bad(
            "bad-positive-beyond-columns",
            "rank 1's positives at columns 8 and 12 of 8",
            (2, 8),
            torch.arange(8),
            4,
            1,
            2,
        ),
    ]


# ---- the case matrix ----------------------------------------------------------------------


def cases(quick: bool = False) -> list[Case]:
    if quick:
        steps = [Step(n=4), Step(n=4, preserve_grad=False, dp=2)]
        padded = [Padded("float", (3, 2, 5, 1), -2.5, preserve_grad=True, h=2), Padded("bool", (2, 4, 1, 3), True)]
        masks = [Mask(4, 4)]
        bad = mask_bad_input_cases()[:1]
    else:
        steps = [Step(n=n) for n in (1, 4)] + [Step(n=n, preserve_grad=False, dp=dp) for n in (1, 4) for dp in (2, 4)]
        padded = [
            Padded("float", (3, 2, 5, 1), -2.5, preserve_grad=True, h=2),
            Padded("float", (3, 2, 5, 1), -2.5),
            Padded("bool", (2, 4, 1, 3), True),
            Padded("int64", (4, 1, 2, 3), 3),
        ]
        masks = [Mask(4, 1), Mask(4, 4), Mask(4, 2, all_same_doc=True)]
        bad = mask_bad_input_cases()
    out = (
        [step_case(s) for s in steps]
        + gather_cases()
        + [padded_case(p) for p in padded]
        + padded_extra_cases()
        + [mask_case(m) for m in masks]
        + bad
    )
    # input the seed does not describe (a 0-d or 1-D tensor, doc ids or sizes that do not fit the scores)
    return cite(out, RULES, bad_input=ours(f"{DOC}#dist_gather_tensor"))


DOC = "docs/ops/inbatch_neg_utils.md"
# Where each property's rule comes from (docs/ops/inbatch_neg_utils.md#rules-seed-or-ours lists them).
RULES = {
    "property:unchanged:*": seed("dist_gather_tensor: 'Returns t unchanged when distributed is not available'"),
    "property:detached": seed(
        "dist_gather_tensor: 'Otherwise, remote slices are detached and only the local slice "
        "keeps gradient flow. Non-gradient tensors, such as masks or IDs, always use a regular "
        "detached gather.'"
    ),
    "property:positive_kept": seed(
        "mask_gathered_passages_same_doc_as_positive: 'The true positive column is left intact.'"
    ),
}


# ---- fuzz spaces (`shardcheck fuzz`) -----------------------------------------------------------------
#
# Every op at every DP size the run allows (world-group ops: (dp, 1, 1) only), any number of rows per rank,
# passages per query, feature sizes and temperatures, doc ids from all distinct to all one doc; the dim-1 padding
# with per-row lengths (so per-rank dim-1 sizes) from 1, a padding value equal to real data, trailing feature dims.

DUPLICATES = [0.0, 0.3, 1.0]


def _gather_params(topologies):
    """dist_gather_tensor: a float tensor (autograd-aware, local-only, without grad), int ids, or the contrastive
    step around it."""
    from hypothesis import strategies as st

    @st.composite
    def params(draw):
        topology = draw(fuzz_topology(topologies, cp=True, legal=_dp_only))
        dp = topology[0]
        kind = draw(st.sampled_from(["float-preserve", "float-local-only", "float-no-grad", "ids", "step"]))
        p = {"topology": topology, "kind": kind, "B": dp * draw(st.integers(1, 3))}
        if kind == "step":
            p.update(
                train_n_passages=draw(st.integers(1, 4)),
                d_in=draw(st.integers(1, 6)),
                d_out=draw(st.integers(1, 5)),
                temperature=draw(st.sampled_from([1.0, 0.5, 0.05])),
                preserve_grad=not draw(st.booleans()),
                duplicates=draw(st.sampled_from(DUPLICATES)),
            )
        else:
            p["H"] = draw(st.integers(1, 4))
        p["dtype"] = draw(st.sampled_from(["float64"] if kind == "ids" else ["float64", "float32", "bfloat16"]))
        return p

    return params()


def _gather_case(p: dict) -> Case:
    if p["kind"] == "step":
        preserve = p["preserve_grad"]
        return step_case(
            Step(
                p["train_n_passages"],
                preserve,
                None if preserve else p["topology"][0],
                p["B"],
                p["d_in"],
                p["d_out"],
                p["temperature"],
                p["duplicates"],
            )
        )
    prefix = "ids-int64" if p["kind"] == "ids" else p["kind"].replace("float-", "float-b{B}h{H}-".format(**p))
    return next(c for c in gather_cases(p["B"], p.get("H", 1)) if c.case_id.startswith(prefix))


def _padded_params(topologies):
    from hypothesis import strategies as st

    @st.composite
    def params(draw):
        topology = draw(fuzz_topology(topologies, cp=True, legal=_dp_only))
        kind = draw(st.sampled_from(["float", "bool", "int64"]))
        rows = topology[0] * draw(st.integers(1, 3))
        values = {"float": [0.0, -2.5, 1e4], "bool": [False, True], "int64": [0, 3, -1]}[kind]
        return {
            "topology": topology,
            "kind": kind,
            "dtype": draw(st.sampled_from(["float64", "float32", "bfloat16"] if kind == "float" else ["float64"])),
            "lengths": draw(st.lists(st.integers(1, 6), min_size=rows, max_size=rows)),
            "padding_value": draw(st.sampled_from(values)),
            "preserve_grad": kind == "float" and draw(st.booleans()),
            "H": draw(st.integers(0, 3)),
        }

    return params()


def _padded_case(p: dict) -> Case:
    return padded_case(Padded(p["kind"], tuple(p["lengths"]), p["padding_value"], p["preserve_grad"], p["H"]))


def _mask_params(topologies):
    from hypothesis import strategies as st

    @st.composite
    def params(draw):
        topology = draw(fuzz_topology(topologies, cp=True, legal=_dp_only))
        return {
            "topology": topology,
            "dtype": draw(st.sampled_from(["float64", "float32", "bfloat16"])),
            "B": topology[0] * draw(st.integers(1, 3)),
            "train_n_passages": draw(st.integers(1, 4)),
            "duplicates": draw(st.sampled_from(DUPLICATES)),
        }

    return params()


def fuzz_spaces() -> list[FuzzSpace]:
    return [
        FuzzSpace(GATHER, _gather_params, _gather_case),
        FuzzSpace(GATHER_PADDED, _padded_params, _padded_case),
        FuzzSpace(
            MASK, _mask_params, lambda p: mask_case(Mask(p["B"], p["train_n_passages"], duplicates=p["duplicates"]))
        ),
    ]
