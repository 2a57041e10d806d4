"""Suite for nemo_rl.distributed.model_utils on the context-parallel (CP) axis.

The TP-only cases live in suites/model_utils.py; these exercise every CP path (CP group of size > 1).
Layouts: sequence-sharded inputs are in the load-balanced head-tail layout (`HeadTail`), head-tail per
packed sequence (`PackedHeadTail`, boundaries from the case's `cu_seqlens_padded`) or the explicit
permutation of the case's `seq_index` (`Permuted`); the harness slices inputs and maps mismatches to
global token positions through those rules.  Per-token results are all-gathered over CP, so they are
replicated over CP and each CP rank's result is a separate summand for the gradients
(`summed_over=("cp",)`: each CP rank gets its own upstream gradient, the golden is that of the sum).

Sequences are 16 long (S divisible by 2·CP for CP 1, 2, 4); "padded" cases hand the op a target
shorter than the logits' sequence (13 of 16): the op pads it and strips the padding from the result.
Inputs, output checks and communication contracts are shared with the TP suite (suites/_model_utils_*.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from shardcheck import (
    REPLICATED,
    BadInput,
    Case,
    FuzzSpace,
    GradConvention,
    GradSum,
    HeadTail,
    Layout,
    PackedHeadTail,
    Partial,
    Permuted,
    Shard,
    ours,
)
from shardcheck.reference import model_utils as ref
from shardcheck.suites._fuzz_draws import DTYPES
from shardcheck.suites._fuzz_draws import topology as fuzz_topology
from shardcheck.suites._model_utils_checks import DOC, cited
from shardcheck.suites._model_utils_comm import (
    A2A_CP,
    AG_CP,
    compute_bytes,
    contract,
    cp_gather_comm,
    distillation_comm,
    gather_logits_comm,
    hidden_comm,
    merge,
    next_token_comm,
    rows,
    s_local,
    with_cp_gather,
)
from shardcheck.suites._model_utils_inputs import (
    NO_SAMPLING,
    Draw,
    Sampling,
    distill_inputs,
    dtensor,
    gather_inputs,
    hidden_inputs,
    make_logits,
    sampling_inputs,
    sampling_params,
)

FAMILY = "model_utils"
OP = FAMILY + "."

SEQ = HeadTail(1)
CP_LOGITS = Layout(dp=Shard(0), cp=SEQ, tp=Shard(-1))  # [B, S, V]: batch over DP, head-tail over CP, vocab over TP
CP_BATCH = Layout(dp=Shard(0), cp=SEQ)  # [B, S, ...] full vocab, head-tail over CP
BATCH = Layout(dp=Shard(0))  # [B, ...] full sequence on every CP rank
PERM_LOGITS = Layout(dp=Shard(0), cp=Permuted(1), tp=Shard(-1))  # CP layout given by the seq_index input
PERM_IDS = Layout(dp=Shard(0), cp=Permuted(1))
CONTIG_LOGITS = Layout(dp=Shard(0), cp=Shard(1), tp=Shard(-1))  # a DTensor's own contiguous sequence shards
CONTIG_IDS = Layout(dp=Shard(0), cp=Shard(1))
PACKED_LOGITS = Layout(cp=PackedHeadTail(1), tp=Shard(-1))  # [1, T, V] packed sequences
PACKED_IDS = Layout(cp=PackedHeadTail(1))
HIDDEN_CP = Layout(dp=Shard(1), cp=HeadTail(0), tp=Shard(0))  # [S, B, H]: head-tail over CP, then SP over TP
WEIGHT = Layout(tp=Shard(0))
SUMMED = ("cp",)  # every CP rank's full-sequence result is its own summand of the loss
BOTH_CONVENTIONS = (GradConvention.SUMMED, GradConvention.OWN)

S = 16  # divisible by 2·CP for CP 1, 2, 4
PADDED = 13  # a target length that is not: padded to 16 by the op


def cp_fits(b: int, tp_rows: int | None = None, v: int | None = None):
    """supports: B divides over DP; for the all-to-all (sampling) paths the local rows B_local·S/CP split over
    TP and the vocab shards are even."""

    def fits(t) -> bool:
        if b % t.dp:
            return False
        if tp_rows is not None and (b // t.dp * tp_rows // t.cp) % t.tp:
            return False
        return v is None or v % t.tp == 0

    return fits


def _case_id(*parts) -> str:
    return "-".join(str(p) for p in parts if p not in (None, ""))


def tags(draw: Draw) -> list[str]:
    """How the draw names a CP case: `<field><value>` of each field away from its default."""
    return [f"{k}{x}" for k, x in draw.extra.items()]


# ---- the layout ops --------------------------------------------------------------------------


@dataclass(frozen=True)
class TokensSpec:
    """_get_tokens_on_this_cp_rank: the full input on every rank, its head-tail piece out (any dtype, any seq_dim)."""

    shape: tuple[int, ...]
    seq_dim: int
    kind: str  # "int64" | "float" | "bool"

    def inputs(self, gen: torch.Generator) -> dict[str, torch.Tensor]:
        if self.kind == "int64":
            return {"x": torch.randint(0, 1000, self.shape, generator=gen)}
        if self.kind == "bool":
            return {"x": torch.rand(self.shape, generator=gen) < 0.5}
        return {"x": make_logits(gen, self.shape)}


TOKENS_SPECS = (
    TokensSpec((2, 16), 1, "int64"),
    TokensSpec((16, 3, 4), 0, "float"),
    TokensSpec((2, 3, 16), 2, "float"),
    TokensSpec((2, 8, 5), 1, "bool"),
)


def tokens_case(spec: TokensSpec) -> Case:
    return Case(
        op=OP + "_get_tokens_on_this_cp_rank",
        case_id=_case_id("x" + "x".join(map(str, spec.shape)), spec.kind, f"seqdim{spec.seq_dim}"),
        params={"shape": list(spec.shape), "seq_dim": spec.seq_dim, "kind": spec.kind},
        make_inputs=spec.inputs,
        reference=lambda x: x["x"].clone(),  # the layout of the full tensor: the harness's HeadTail rule slices it
        run=lambda impl, ctx, x: impl._get_tokens_on_this_cp_rank(
            x["x"], ctx.rank("cp"), ctx.size("cp"), seq_dim=spec.seq_dim
        ),
        output_layouts=(Layout(cp=HeadTail(spec.seq_dim)),),
        dtypes=("float64", "float32", "bfloat16") if spec.kind == "float" else ("float64",),
        supports=lambda t: t.tp == 1 and t.dp == 1,
        comm=contract(lambda ctx: ({}, {})),  # a local slice
        cp_lengths=(spec.shape[spec.seq_dim],),
    )


def tokens_not_divisible_case() -> Case:
    """A length not divisible by 2·CP: no layout is documented for it, so the op must raise (never drop a tail)."""
    return Case(
        op=OP + "_get_tokens_on_this_cp_rank",
        case_id="x2x6-not-divisible",
        params={"shape": [2, 6], "seq_dim": 1},
        make_inputs=lambda gen: {"x": torch.randint(0, 100, (2, 6), generator=gen)},
        reference=lambda x: None,
        run=lambda impl, ctx, x: impl._get_tokens_on_this_cp_rank(x["x"], ctx.rank("cp"), ctx.size("cp"), seq_dim=1),
        bad_input=BadInput("a sequence of 6 tokens, not divisible by 2·CP = 8"),
        dtypes=("float64",),
        context_parallel=True,
        supports=lambda t: t.cp == 4 and t.dp == 1 and t.tp == 1,
    )


@dataclass(frozen=True)
class AllGatherSpec:
    """AllGatherCPTensor / allgather_cp_sharded_tensor: head-tail pieces in, the full tensor on every rank.
    `upstream` "sum_last" / "sum_all" hand the backward an expanded gradient (what out.sum().backward() gives)."""

    op: str
    shape: tuple[int, ...]
    seq_dim: int
    upstream: str = "none"

    @property
    def batch_dim(self) -> int:
        return 1 if self.seq_dim == 0 else 0

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        return y.sum(-1) if self.upstream == "sum_last" else y.sum() if self.upstream == "sum_all" else y


ALL_GATHER_SPECS = (
    AllGatherSpec("allgather_cp_sharded_tensor", (4, 16, 3), 1),
    AllGatherSpec("allgather_cp_sharded_tensor", (16, 2, 3), 0, "sum_last"),
    AllGatherSpec("AllGatherCPTensor", (2, 3, 16), 2, "sum_all"),
    AllGatherSpec("AllGatherCPTensor", (4, 16, 3), 1, "sum_last"),
)


def all_gather_case(spec: AllGatherSpec) -> Case:
    def run(impl, ctx, x):
        if spec.op == "AllGatherCPTensor":
            return spec.finish(impl.AllGatherCPTensor.apply(x["x"], ctx.group("cp"), spec.seq_dim))
        return spec.finish(impl.allgather_cp_sharded_tensor(x["x"], ctx.group("cp"), seq_dim=spec.seq_dim))

    def comm(ctx):
        numel = 1
        for n in ctx.local_shape("x"):
            numel *= n
        e_in = ctx.dtype.itemsize
        return {AG_CP: (1, numel * e_in)}, {A2A_CP: (1, ctx.size("cp") * numel * e_in)}

    # a sum over everything is a per-DP-rank partial sum of the global one
    out_layout = Layout(dp=Partial()) if spec.upstream == "sum_all" else Layout(dp=Shard(spec.batch_dim))
    return Case(
        op=OP + spec.op,
        case_id=_case_id("x" + "x".join(map(str, spec.shape)), f"seqdim{spec.seq_dim}", spec.upstream),
        params={"shape": list(spec.shape), "seq_dim": spec.seq_dim, "upstream": spec.upstream},
        make_inputs=lambda gen: {"x": make_logits(gen, spec.shape)},
        reference=lambda x: spec.finish(x["x"] * 1.0),
        run=run,
        input_layouts={"x": Layout(dp=Shard(spec.batch_dim), cp=HeadTail(spec.seq_dim))},
        output_layouts=(out_layout,),
        grad_inputs=("x",),
        summed_over=SUMMED,
        comm=contract(comm),
        supports=lambda t: spec.shape[spec.batch_dim] % t.dp == 0 and t.tp == 1,
    )


def layout_cases(quick: bool) -> list[Case]:
    return (
        [tokens_case(s) for s in (TOKENS_SPECS[:2] if quick else TOKENS_SPECS)]
        + [tokens_not_divisible_case()]
        + [all_gather_case(s) for s in (ALL_GATHER_SPECS[1:3] if quick else ALL_GATHER_SPECS)]
    )


# ---- next-token log-probs: from_parallel_logits_to_logprobs and its fronts --------------------

DEFAULT_DRAW = Draw()  # frozen: one instance serves as every call's default


def next_token_inputs(gen, b: int, v: int, smp: Sampling, target_len: int = S, draw: Draw = DEFAULT_DRAW, s: int = S):
    """Logits [B, S, V]; an unshifted target [B, target_len] (the op pads a shorter one)."""
    x = sampling_inputs(gen, b, s, v, smp, draw, shift=True)
    x["target"] = x["target"][:, :target_len].contiguous()
    return x


def next_token_reference(smp: Sampling):
    def reference(x):
        n = x["target"].shape[1]  # positions past the target (padding) are not scored
        if smp == NO_SAMPLING:
            return ref.next_token_logprobs(x["logits"][:, :n], x["target"])
        return ref.next_token_sampling_logprobs(x["logits"][:, :n], x["target"], smp.top_k, smp.top_p, smp.temperature)

    return reference


@dataclass(frozen=True)
class NextTokenSpec:
    b: int
    v: int
    sampling: Sampling = NO_SAMPLING
    chunk: int | None = None
    target_len: int = S
    draw: Draw = Draw()
    s: int = S

    def inputs(self, gen: torch.Generator) -> dict[str, torch.Tensor]:
        return next_token_inputs(gen, self.b, self.v, self.sampling, self.target_len, self.draw, self.s)


NEXT_TOKEN_SPECS = (
    NextTokenSpec(4, 37, draw=Draw(masked=0.2)),  # uneven vocab shards, masked targets
    NextTokenSpec(2, 24, chunk=3, target_len=PADDED),  # chunked (3 does not divide S/CP), padded target
    NextTokenSpec(2, 32, Sampling(top_k=5, top_p=0.9, temperature=0.7), draw=Draw(ties=True)),  # ties at the k-th
    NextTokenSpec(2, 32, Sampling(top_k=4, temperature=1.5), 2, PADDED, Draw(masked=0.2)),  # chunked sampling, padded
    NextTokenSpec(2, 33, target_len=PADDED, draw=Draw(scale=300.0)),  # huge logits
)


def next_token_case(spec: NextTokenSpec) -> Case:
    smp = spec.sampling

    def run(impl, ctx, x):
        start, end = ctx.local_range("logits", -1)
        return impl.from_parallel_logits_to_logprobs(
            x["logits"],
            x["target"],
            start,
            end,
            ctx.group("tp"),
            cp_group=ctx.group("cp"),
            chunk_size=spec.chunk,
            sampling_params=sampling_params(smp),
        )

    n = spec.target_len
    return Case(
        op=OP + "from_parallel_logits_to_logprobs",
        case_id=_case_id(
            f"cp-b{spec.b}s{spec.s}v{spec.v}",
            f"target{n}" if n != spec.s else "",
            smp.tag(),
            f"chunk{spec.chunk}",
            *tags(spec.draw),
        ),
        params={
            "B": spec.b,
            "S": spec.s,
            "V": spec.v,
            "target_len": n,
            "chunk_size": spec.chunk,
            **spec.draw.extra,
            **smp.params(),
        },
        make_inputs=spec.inputs,
        reference=next_token_reference(smp),
        run=run,
        input_layouts={"logits": CP_LOGITS, "target": BATCH},
        output_layouts=(BATCH,),
        grad_inputs=("logits",),
        summed_over=SUMMED,
        supports=cp_fits(spec.b, spec.s, spec.v) if smp.filtering else cp_fits(spec.b),
        comm=with_cp_gather(lambda ctx: next_token_comm(ctx, s_local(ctx), smp, spec.chunk), rows),
    )


def _permutation(gen, kind: str, length: int = S) -> torch.Tensor:
    if kind == "random":
        return torch.randperm(length, generator=gen)
    # the head-tail layout of CP = 2 written as a permutation (how a trainer describes it)
    return torch.cat([torch.arange(0, 4), torch.arange(12, 16), torch.arange(4, 12)])


@dataclass(frozen=True)
class FrontEndSpec:
    """A front end with CP: `variant` names how it is called; `permutation` ("random" or "head_tail") the
    seq_index it is given (None: the DTensor's own contiguous Shard(1), or the head-tail rule)."""

    op: str
    variant: str
    logits: NextTokenSpec
    permutation: str | None = None

    @property
    def layouts(self) -> tuple[Layout, Layout]:
        """(logits, ids) layouts."""
        if self.variant == "plain":
            return CP_BATCH, BATCH
        if self.variant == "vocab_parallel_group":
            return CP_LOGITS, BATCH
        return (CONTIG_LOGITS, CONTIG_IDS) if self.permutation is None else (PERM_LOGITS, PERM_IDS)

    def inputs(self, gen: torch.Generator) -> dict[str, torch.Tensor]:
        x = self.logits.inputs(gen)
        if self.permutation is not None:
            x["seq_index"] = _permutation(gen, self.permutation, self.logits.s)
        return x


FRONT_END_SPECS = (
    FrontEndSpec(
        "dtensor_from_parallel_logits_to_logprobs", "seq_index", NextTokenSpec(4, 37, draw=Draw(masked=0.2)), "random"
    ),
    FrontEndSpec(
        "dtensor_from_parallel_logits_to_logprobs",
        "seq_index",
        NextTokenSpec(2, 32, Sampling(top_k=5, temperature=0.7), 3),
        "head_tail",
    ),
    FrontEndSpec("get_logprobs_from_vocab_parallel_logits", "seq_index", NextTokenSpec(2, 37, chunk=2), "random"),
    FrontEndSpec(
        "get_logprobs_from_vocab_parallel_logits",
        "shard1",
        NextTokenSpec(4, 24, Sampling(top_p=0.8), draw=Draw(masked=0.2)),
    ),
    # the DTensor's own Shard(1) without seq_index on ids in [0, V): a CP layout the seed leaves open (it gives a
    # seq_index with CP-sharded logits), judged under our rule at CP ≥ 2 as the masked case above is
    FrontEndSpec("get_logprobs_from_vocab_parallel_logits", "shard1", NextTokenSpec(2, 32)),
    FrontEndSpec(
        "get_next_token_logprobs_from_logits", "vocab_parallel_group", NextTokenSpec(2, 32, draw=Draw(masked=0.2))
    ),
    # ids in [0, V), no sampling: the seed's own input at CP, beside which a raise on the other variants' input (masked
    # ids, a temperature, plain logits with a CP group) reads as a raise on input only our rule feeds
    FrontEndSpec("get_next_token_logprobs_from_logits", "vocab_parallel_group", NextTokenSpec(2, 32)),
    FrontEndSpec(
        "get_next_token_logprobs_from_logits", "plain", NextTokenSpec(2, 24, Sampling(top_k=4, temperature=1.3))
    ),
    FrontEndSpec(
        "get_next_token_logprobs_from_logits", "dtensor", NextTokenSpec(2, 32, Sampling(temperature=1.5)), "random"
    ),
)


def front_end_case(spec: FrontEndSpec) -> Case:
    """dtensor_from_parallel_logits_to_logprobs (seq_index), get_logprobs_from_vocab_parallel_logits (DTensor
    logits, seq_index or the DTensor's own Shard(1)), get_next_token_logprobs_from_logits (its three paths)."""
    lg, smp = spec.logits, spec.logits.sampling
    logits_layout, ids_layout = spec.layouts

    def run(impl, ctx, x):
        sp, seq_index = sampling_params(smp), x.get("seq_index")
        ids = dtensor(ctx, x["target"], "target", ids_layout, ("cp",))
        if spec.op == "dtensor_from_parallel_logits_to_logprobs":
            start, end = ctx.local_range("logits", -1)
            return impl.dtensor_from_parallel_logits_to_logprobs(
                x["logits"],
                ids,
                start,
                end,
                ctx.group("tp"),
                seq_index=seq_index,
                chunk_size=lg.chunk,
                sampling_params=sp,
            )
        logits = dtensor(ctx, x["logits"], "logits", logits_layout)
        if spec.op == "get_logprobs_from_vocab_parallel_logits":
            return impl.get_logprobs_from_vocab_parallel_logits(
                logits, ids, seq_index=seq_index, chunk_size=lg.chunk, sampling_params=sp
            )
        if spec.variant == "dtensor":
            return impl.get_next_token_logprobs_from_logits(ids, logits, seq_index=seq_index, sampling_params=sp)
        kw = (
            dict(vocab_parallel_rank=ctx.rank("tp"), vocab_parallel_group=ctx.group("tp"))
            if spec.variant == "vocab_parallel_group"
            else {}
        )
        return impl.get_next_token_logprobs_from_logits(
            x["target"], x["logits"], context_parallel_group=ctx.group("cp"), sampling_params=sp, **kw
        )

    replicated = spec.variant == "plain"
    ids_gather = (
        ids_layout is not BATCH and spec.op != "get_next_token_logprobs_from_logits" or spec.variant == "dtensor"
    )
    tp_contract = (
        (lambda ctx: ({}, {})) if replicated else (lambda ctx: next_token_comm(ctx, s_local(ctx), smp, lg.chunk))
    )
    even = spec.variant == "vocab_parallel_group"
    supports = (
        cp_fits(lg.b)
        if replicated
        else cp_fits(lg.b, lg.s if smp.filtering else None, lg.v if smp.filtering or even else None)
    )
    if spec.permutation is not None:  # seed: a seq_index "is only provided for cp sharded logits"
        fits = supports
        supports = lambda t: t.cp > 1 and fits(t)  # noqa: E731
    return Case(
        op=OP + spec.op,
        case_id=_case_id(
            "cp",
            spec.variant,
            f"b{lg.b}s{lg.s}v{lg.v}",
            smp.tag(),
            f"chunk{lg.chunk}" if lg.chunk else "",
            spec.permutation and f"perm_{spec.permutation}",
            *tags(lg.draw),
        ),
        params={
            "variant": spec.variant,
            "B": lg.b,
            "S": lg.s,
            "V": lg.v,
            "chunk_size": lg.chunk,
            "permutation": spec.permutation,
            **lg.draw.extra,
            **smp.params(),
        },
        make_inputs=spec.inputs,
        reference=next_token_reference(smp),
        run=run,
        input_layouts={"logits": logits_layout, "target": ids_layout},
        output_layouts=(BATCH,),
        grad_inputs=("logits",),
        summed_over=SUMMED,
        # the seed gathers a DTensor front end's result with `full_tensor()`, whose backward keeps each rank's own
        # upstream gradient; it fixes neither convention: both pass
        grad_conventions=BOTH_CONVENTIONS if ids_gather else (GradConvention.SUMMED,),
        supports=supports,
        comm=with_cp_gather(tp_contract, rows, ids_gather=ids_gather),
    )


# ---- gathers at global ids, distillation, hidden states -------------------------------------


@dataclass(frozen=True)
class GatherSpec:
    """gather_logits_at_global_indices with CP: K ids per position; `tp_group` "none": the full vocab on every rank."""

    b: int
    v: int
    k: int
    tp_group: str = "tp"
    draw: Draw = Draw()
    s: int = S


GATHER_SPECS = (
    GatherSpec(4, 37, 5, draw=Draw(masked=0.2)),
    GatherSpec(2, 32, 4, draw=Draw(scale=300.0)),
    GatherSpec(2, 24, 3, "none"),
    GatherSpec(2, 37, 4, draw=Draw(neg_inf=0.3)),
)  # ids on -inf logits, through the TP sum and the CP gather


def gather_case(spec: GatherSpec) -> Case:
    sharded = spec.tp_group == "tp"

    def run(impl, ctx, x):
        start, end = ctx.local_range("logits", -1) if sharded else (0, spec.v)
        return impl.gather_logits_at_global_indices(
            x["logits"],
            x["indices"],
            ctx.group("tp") if sharded else None,
            ctx.group("cp"),
            vocab_start_index=start,
            vocab_end_index=end,
        )

    tp_contract = (lambda ctx: gather_logits_comm(ctx, spec.k)) if sharded else (lambda ctx: ({}, {}))
    return Case(
        op=OP + "gather_logits_at_global_indices",
        case_id=_case_id(
            f"cp-b{spec.b}s{spec.s}v{spec.v}-k{spec.k}-dup", f"tp_group_{spec.tp_group}", *tags(spec.draw)
        ),
        params={"B": spec.b, "S": spec.s, "V": spec.v, "K": spec.k, "tp_group": spec.tp_group, **spec.draw.extra},
        make_inputs=lambda gen: gather_inputs(gen, spec.b, spec.s, spec.v, spec.k, spec.draw),
        reference=lambda x: ref.gather_logits(x["logits"], x["indices"]),
        run=run,
        input_layouts={"logits": CP_LOGITS if sharded else CP_BATCH, "indices": BATCH},
        output_layouts=(BATCH,),
        grad_inputs=("logits",),
        summed_over=SUMMED,
        supports=cp_fits(spec.b),
        comm=with_cp_gather(tp_contract, lambda ctx: rows(ctx) * spec.k),
    )


@dataclass(frozen=True)
class DistillSpec:
    b: int
    v: int
    k: int
    zero_outside_topk: bool
    calculate_entropy: bool
    path: str = "group"  # "group" (vocab_parallel_rank and group) or "plain" (full vocab)
    draw: Draw = Draw()
    s: int = S


DISTILL_SPECS = (
    DistillSpec(2, 32, 4, False, True),
    DistillSpec(2, 32, 4, True, True),
    DistillSpec(4, 24, 3, True, False, "plain", Draw(ties=True)),
    DistillSpec(2, 32, 4, False, False, draw=Draw(scale=300.0)),
    # almost one-hot rows, full vocab: only the entropy's gradient is left (the log-softmax over K = 1
    # id is 0), ~1e-28 at the row's max, where autograd through p log p gives 0
    DistillSpec(2, 5, 1, False, True, "plain", Draw(scale=300.0)),
)


def distillation_case(spec: DistillSpec) -> Case:
    zero, ent = spec.zero_outside_topk, spec.calculate_entropy

    def run(impl, ctx, x):
        kw = (
            dict(vocab_parallel_rank=ctx.rank("tp"), vocab_parallel_group=ctx.group("tp"))
            if spec.path == "group"
            else {}
        )
        return impl.get_distillation_topk_logprobs_from_logits(
            x["student_logits"],
            x["teacher_topk_logits"],
            x["teacher_topk_indices"],
            zero,
            ent,
            context_parallel_group=ctx.group("cp"),
            **kw,
        )

    def comm(ctx):
        fwd, bwd = (
            distillation_comm(ctx, s_local(ctx, "student_logits"), spec.k, zero, ent)
            if spec.path == "group"
            else ({}, {})
        )
        n = rows(ctx, "student_logits")
        for numel in [n * spec.k] + ([n] if ent else []):  # student log-probs, then H_all
            f2, b2 = cp_gather_comm(ctx, numel, compute_bytes(ctx))
            fwd, bwd = merge(fwd, f2), merge(bwd, b2)
        return fwd, bwd

    return Case(
        op=OP + "get_distillation_topk_logprobs_from_logits",
        case_id=_case_id(
            f"cp-b{spec.b}s{spec.s}v{spec.v}-k{spec.k}",
            f"zero_outside_{zero}",
            f"entropy_{ent}",
            spec.path,
            *tags(spec.draw),
        ),
        params={
            "B": spec.b,
            "S": spec.s,
            "V": spec.v,
            "K": spec.k,
            "zero_outside_topk": zero,
            "calculate_entropy": ent,
            "path": spec.path,
            **spec.draw.extra,
        },
        make_inputs=lambda gen: distill_inputs(gen, spec.b, spec.s, spec.v, spec.k, spec.draw),
        reference=lambda x: ref.distillation_topk_logprobs(
            x["student_logits"], x["teacher_topk_logits"], x["teacher_topk_indices"], zero, ent
        ),
        run=run,
        input_layouts={
            "student_logits": CP_LOGITS if spec.path == "group" else CP_BATCH,
            "teacher_topk_logits": BATCH,
            "teacher_topk_indices": BATCH,
        },
        output_layouts=(BATCH, BATCH, BATCH if ent else REPLICATED),
        output_names=("student", "teacher", "H_all"),
        grad_inputs=("student_logits",),
        summed_over=SUMMED,
        supports=cp_fits(spec.b, v=spec.v) if spec.path == "group" else cp_fits(spec.b),
        comm=contract(comm),
    )


@dataclass(frozen=True)
class HiddenSpec:
    """from_parallel_hidden_states_to_logprobs with CP: hidden states [S, B, H], weight [V, H]."""

    b: int
    h: int
    v: int
    chunk: int | None = None
    target_len: int = S
    scale: float = 1.0
    masked: float = 0.0
    s: int = S

    @property
    def extra(self) -> dict:
        """scale and masked where they differ from the defaults (1.0, 0.0)."""
        return {k: x for k, x, default in (("scale", self.scale, 1.0), ("masked", self.masked, 0.0)) if x != default}

    def inputs(self, gen: torch.Generator) -> dict[str, torch.Tensor]:
        x = hidden_inputs(gen, self.s, self.b, self.h, self.v, self.scale, self.masked)
        x["target"] = x["target"][:, : self.target_len].contiguous()
        return x


HIDDEN_SPECS = (HiddenSpec(2, 8, 32), HiddenSpec(2, 6, 37, 3, PADDED, masked=0.2), HiddenSpec(4, 8, 24, 2, scale=3.0))


def hidden_states_case(spec: HiddenSpec) -> Case:
    def run(impl, ctx, x):
        weight = GradSum.apply(x["weight"], (ctx.group("dp"), ctx.group("cp")))
        return impl.from_parallel_hidden_states_to_logprobs(
            x["hidden"],
            None,
            weight,
            False,
            x["target"],
            *ctx.local_range("weight", 0),
            ctx.group("tp"),
            cp_group=ctx.group("cp"),
            chunk_size=spec.chunk,
        )

    def comm(ctx):
        s_cp = spec.s // ctx.size("cp")
        fwd, bwd = hidden_comm(ctx, s_cp, spec.chunk)
        if ctx.size("cp") > 1:  # the DDP stand-in sums the weight gradient over CP too
            bwd = merge(
                bwd,
                {
                    "all_reduce@cp": (
                        1,
                        ctx.local_shape("weight")[0] * ctx.full_shapes["weight"][1] * compute_bytes(ctx),
                    )
                },
            )
        f2, b2 = cp_gather_comm(ctx, ctx.local_shape("hidden")[1] * s_cp, compute_bytes(ctx))
        return merge(fwd, f2), merge(bwd, b2)

    n = spec.target_len
    return Case(
        op=OP + "from_parallel_hidden_states_to_logprobs",
        case_id=_case_id(
            f"cp-s{spec.s}b{spec.b}h{spec.h}v{spec.v}",
            f"target{n}" if n != spec.s else "",
            f"chunk{spec.chunk}",
            *[f"{k}{x}" for k, x in spec.extra.items()],
        ),
        params={
            "S": spec.s,
            "B": spec.b,
            "H": spec.h,
            "V": spec.v,
            "target_len": n,
            "chunk_size": spec.chunk,
            **spec.extra,
        },
        make_inputs=spec.inputs,
        reference=lambda x: ref.hidden_states_to_logprobs(
            x["hidden"][: x["target"].shape[1]], x["weight"], x["target"]
        ),
        run=run,
        input_layouts={"hidden": HIDDEN_CP, "weight": WEIGHT, "target": BATCH},
        output_layouts=(BATCH,),
        grad_inputs=("hidden", "weight"),
        summed_over=SUMMED,
        comm=contract(comm),
        supports=lambda t: spec.b % t.dp == 0 and (spec.s // t.cp) % t.tp == 0,
    )


# ---- packed sequences ------------------------------------------------------------------------


@dataclass(frozen=True)
class PackedSpec:
    """One packed row of sequences: `padded` lengths (each divisible by 2·CP), `real` tokens of each (pad id after
    them); result rows `unpacked_seqlen` − 1 wide.  `pre_rolled`: the target is already shifted per sequence."""

    padded: tuple[int, ...]
    real: tuple[int, ...]
    v: int
    unpacked_seqlen: int
    sampling: Sampling = NO_SAMPLING
    chunk: int | None = None
    pre_rolled: bool = False
    draw: Draw = Draw()


PACKED_SPECS = (
    PackedSpec((8, 16, 8), (5, 16, 8), 37, 16, draw=Draw(masked=0.1)),  # unequal lengths, uneven vocab
    PackedSpec((16, 8), (11, 3), 32, 20, chunk=3, pre_rolled=True),  # pre-rolled, chunked, rows wider than any sequence
    PackedSpec((8, 8, 16), (8, 6, 9), 32, 12, Sampling(top_k=5, temperature=0.8)),  # sampling; row 3 truncated
    PackedSpec((16, 16), (16, 12), 24, 16, chunk=2, draw=Draw(scale=300.0)),  # huge logits, chunked
)


def packed_inputs(gen, spec: PackedSpec, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """The packed row's logits and target (pad id past each sequence's real tokens) and cu_seqlens_padded."""
    T = sum(spec.padded)
    x = sampling_inputs(gen, 1, T, spec.v, spec.sampling, spec.draw)
    target = x["target"].clone()
    start = 0
    for p, r in zip(spec.padded, spec.real):
        target[:, start + r : start + p] = pad_id  # padding tokens, as a packer writes them
        start += p
    bounds = torch.tensor([0, *torch.tensor(spec.padded).cumsum(0).tolist()])
    if spec.pre_rolled:
        target = torch.cat([target[:, a:b].roll(-1, dims=1) for a, b in zip(bounds[:-1], bounds[1:])], dim=1)
    return {"logits": x["logits"], "target": target, "cu_seqlens_padded": bounds}


def packed_case(spec: PackedSpec) -> Case:
    smp, T = spec.sampling, sum(spec.padded)

    def run(impl, ctx, x):
        start, end = ctx.local_range("logits", -1)
        return impl.from_parallel_logits_to_logprobs_packed_sequences(
            x["logits"],
            x["target"],
            x["cu_seqlens_padded"],
            spec.unpacked_seqlen,
            start,
            end,
            ctx.group("tp"),
            cp_group=ctx.group("cp"),
            chunk_size=spec.chunk,
            sampling_params=sampling_params(smp),
            target_is_pre_rolled=spec.pre_rolled,
        )

    return Case(
        op=OP + "from_parallel_logits_to_logprobs_packed_sequences",
        case_id=_case_id(
            "packed",
            "-".join(f"{r}of{p}" for p, r in zip(spec.padded, spec.real)),
            f"v{spec.v}",
            smp.tag(),
            f"chunk{spec.chunk}",
            "pre_rolled" if spec.pre_rolled else "",
            f"unpacked{spec.unpacked_seqlen}",
            *tags(spec.draw),
        ),
        params={
            "padded": list(spec.padded),
            "real": list(spec.real),
            "V": spec.v,
            "chunk_size": spec.chunk,
            "pre_rolled": spec.pre_rolled,
            "unpacked_seqlen": spec.unpacked_seqlen,
            **spec.draw.extra,
            **smp.params(),
        },
        make_inputs=lambda gen: packed_inputs(gen, spec),
        reference=lambda x: ref.packed_next_token_logprobs(
            x["logits"],
            x["target"],
            x["cu_seqlens_padded"],
            spec.unpacked_seqlen,
            spec.pre_rolled,
            smp.top_k,
            smp.top_p,
            smp.temperature,
        ),
        run=run,
        input_layouts={"logits": PACKED_LOGITS, "target": PACKED_IDS if spec.pre_rolled else REPLICATED},
        output_layouts=(REPLICATED,),
        grad_inputs=("logits",),
        summed_over=SUMMED,
        supports=lambda t: t.dp == 1 and (not smp.filtering or ((T // t.cp) % t.tp == 0 and spec.v % t.tp == 0)),
        comm=with_cp_gather(lambda ctx: next_token_comm(ctx, s_local(ctx), smp, spec.chunk), rows),
    )


# ---- scale: CP 8 and 16 ------------------------------------------------------------------------------

SCALE_S = 32  # the matrix's S = 16 splits head-tail up to CP 4 only; 32 = 2·16 splits up to CP 16


def at_scale(case: Case) -> Case:
    """`case` planned only at CP 8 and up, where the matrix's sequences cannot be split head-tail: the default
    1/2/4 run does not grow."""
    supports = case.supports
    return replace(case, supports=lambda t: t.cp >= 8 and supports(t))


def scale_cases() -> list[Case]:
    """A case of every sequence-sharding op at S = 32 (packed sequences of 32 and 64), CP 8 and 16 only."""
    return [
        at_scale(c)
        for c in (
            tokens_case(TokensSpec((SCALE_S, 3, 2), 0, "float")),
            all_gather_case(AllGatherSpec("allgather_cp_sharded_tensor", (2, SCALE_S, 3), 1, "sum_last")),
            all_gather_case(AllGatherSpec("AllGatherCPTensor", (2, 3, SCALE_S), 2, "sum_all")),
            next_token_case(NextTokenSpec(2, 37, chunk=3, target_len=29, draw=Draw(masked=0.2), s=SCALE_S)),
            front_end_case(
                FrontEndSpec(
                    "get_next_token_logprobs_from_logits",
                    "vocab_parallel_group",
                    NextTokenSpec(2, 32, draw=Draw(masked=0.2), s=SCALE_S),
                )
            ),
            front_end_case(
                FrontEndSpec(
                    "get_next_token_logprobs_from_logits",
                    "plain",
                    NextTokenSpec(2, 24, Sampling(top_k=4, temperature=1.3), s=SCALE_S),
                )
            ),
            gather_case(GatherSpec(2, 37, 4, draw=Draw(neg_inf=0.3), s=SCALE_S)),
            distillation_case(DistillSpec(2, 32, 4, True, True, s=SCALE_S)),
            hidden_states_case(HiddenSpec(2, 6, 37, 3, 29, masked=0.2, s=SCALE_S)),
            packed_case(
                PackedSpec((SCALE_S, 2 * SCALE_S), (21, 64), 33, 40, chunk=3, pre_rolled=True, draw=Draw(masked=0.1))
            ),
        )
    ]


# ---- the case matrix -----------------------------------------------------------------------------


def cases(quick: bool = False) -> list[Case]:
    # The vocab-parallel ops support a TP rank holding no vocab entries (V = 37 at TP 16): the cases test them.
    return cited(_matrix(quick) + scale_cases(), bad_input=ours(f"{DOC}#context-parallel-layout"))


def _matrix(quick: bool) -> list[Case]:
    if quick:
        return (
            layout_cases(quick)
            + [next_token_case(NEXT_TOKEN_SPECS[i]) for i in (1, 3)]
            + [front_end_case(FRONT_END_SPECS[i]) for i in (0, 3, 5, 6)]
            + [gather_case(s) for s in GATHER_SPECS[2:]]
            + [distillation_case(s) for s in DISTILL_SPECS[:2]]
            + [hidden_states_case(HIDDEN_SPECS[1])]
            + [packed_case(s) for s in PACKED_SPECS[:2]]
        )
    return (
        layout_cases(quick)
        + [next_token_case(s) for s in NEXT_TOKEN_SPECS]
        + [front_end_case(s) for s in FRONT_END_SPECS]
        + [gather_case(s) for s in GATHER_SPECS]
        + [distillation_case(s) for s in DISTILL_SPECS]
        + [hidden_states_case(s) for s in HIDDEN_SPECS]
        + [packed_case(s) for s in PACKED_SPECS]
    )


# ---- fuzz spaces (`shardcheck fuzz`) -----------------------------------------------------------------
#
# Every op of this suite at every topology the run allows where its case runs: sequence lengths any multiple of
# 2·CP (any length at CP 1), targets shorter than the logits (padded by the op), uneven and empty vocab shards,
# B over DP, chunk sizes from 1 past the local sequence, top-k from 1 past a shard's vocabulary, top-p, temperature,
# masked and out-of-range ids, ties, huge and -inf logits, random seq_index permutations, packed rows of 1-3
# sequences of any padded length (a multiple of 2·CP) with rows narrower or wider than the sequences.


def _draw_sampling(draw, st) -> dict:
    """top_k None, or 1 to past a vocab shard (12 > V_local of most draws at TP 4); top_p; temperature."""
    return {
        "top_k": draw(st.one_of(st.none(), st.integers(1, 12))),
        "top_p": draw(st.sampled_from([1.0, 0.9, 0.5])),
        "temperature": draw(st.sampled_from([1.0, 0.7, 1.5])),
    }


def _filtering(p: dict) -> bool:
    return Sampling(p["top_k"], p["top_p"], p["temperature"]).filtering


def _draw_sizes(draw, st, topology: list[int], even_rows: bool, even_vocab: bool, max_chunks: int = 3) -> dict:
    """B = DP·k, S a multiple of 2·CP (any S ≥ 2 at CP 1), V from 3 (empty shards at TP 4); `even_rows`: the local
    B·S/CP rows split over TP (the all-to-all layouts), `even_vocab`: V divisible by TP."""
    dp, cp, tp = topology
    k = draw(st.integers(1, 2))
    unit, lo, hi = (1, 2, 9) if cp == 1 else (2 * cp, 1, max_chunks)
    m = draw(st.integers(lo, hi).filter(lambda m: not even_rows or (k * unit * m // cp) % tp == 0))
    v = draw(st.integers(3, 40).filter(lambda v: not even_vocab or v % tp == 0))
    return {"B": dp * k, "S": unit * m, "V": v}


def _draw_logits(draw, st, neg_inf: bool = False) -> dict:
    p = {
        "scale": draw(st.sampled_from([3.0, 300.0])),
        "ties": draw(st.booleans()),
        "masked": draw(st.sampled_from([0.0, 0.2, 0.5])),
    }
    if neg_inf:
        p["neg_inf"] = draw(st.sampled_from([0.0, 0.3]))
    return p


def _draw(p: dict) -> Draw:
    return Draw(scale=p["scale"], ties=p["ties"], neg_inf=p.get("neg_inf", 0.0), masked=p["masked"])


# The log-prob gradient of a next-token row is (onehot − p)/T: on a near one-hot row whose target is the argmax it
# is 1 − p_max, smaller than the rounding of p_max (an ulp of 1·|g|) can referee.  float64: a rank whose scored
# rows are all more one-hot than ~e^−8 (few positions, masked targets, ×100 logits) gets a check (1e-10 of its
# largest element) that the golden fails by 1e-8..1e-4 itself.  float32: the budget's floor is 24 ulps of the
# row's largest element, 1 − p_max, short of one rounding of p_max once 1 − p_max < ~1/24, and the rest of it,
# 30·err_naive, is the reference's luck on that one rounding (a correct op failed 1 row in ~1000 at scale 3).
# So these draws keep each row's runner-up within TOP_GAP[dtype] of its max.
TOP_GAP = {"float64": 4.0, "float32": 1.5, "bfloat16": 4.0}


def _sampling_draw(p: dict) -> Draw:
    return replace(_draw(p), top_gap=TOP_GAP[p["dtype"]])


def _chunk(draw, st):
    return draw(st.one_of(st.none(), st.integers(1, 7)))


def _space(legal, body):
    """params(topologies): a topology legal for the op, a dtype, then `body(draw, st, topology)`'s parameters."""

    def params(topologies):
        from hypothesis import strategies as st

        @st.composite
        def draw_params(draw):
            topology = draw(fuzz_topology(topologies, cp=True, legal=legal))
            p = {"topology": topology, **body(draw, st, topology)}
            p.setdefault("dtype", draw(st.sampled_from(DTYPES)))
            return p

        return draw_params()

    return params


def _tokens_body(draw, st, topology):
    ndim = draw(st.integers(1, 3))
    seq_dim = draw(st.integers(0, ndim - 1))
    shape = [
        2 * topology[1] * draw(st.integers(1, 4)) if d == seq_dim else draw(st.integers(1, 3)) for d in range(ndim)
    ]
    kind = draw(st.sampled_from(["float", "int64", "bool"]))
    p = {"shape": shape, "seq_dim": seq_dim, "kind": kind}
    if kind != "float":
        p["dtype"] = "float64"
    return p


def _all_gather_body(draw, st, topology):
    ndim = draw(st.integers(2, 3))
    seq_dim = draw(st.integers(0, ndim - 1))
    batch_dim = 1 if seq_dim == 0 else 0
    shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
    shape[seq_dim] = 2 * topology[1] * draw(st.integers(1, 4))
    shape[batch_dim] = topology[0] * draw(st.integers(1, 2))
    # "sum_last" only where the last dim is neither the batch (laid out over DP) nor the sequence
    upstreams = ["none", "sum_last", "sum_all"] if ndim - 1 not in (seq_dim, batch_dim) else ["none", "sum_all"]
    return {"shape": shape, "seq_dim": seq_dim, "upstream": draw(st.sampled_from(upstreams))}


def _next_token_body(draw, st, topology, even_vocab: bool = False, short_target: bool = True):
    """`short_target`: a target shorter than the logits' sequence (padded by the op); the fronts that take the ids
    as a DTensor laid out like the logits get the full length."""
    p = _draw_sampling(draw, st)
    p.update(_draw_sizes(draw, st, topology, _filtering(p), _filtering(p) or even_vocab))
    p.update(
        chunk_size=_chunk(draw, st),
        target_len=draw(st.integers(2, p["S"])) if short_target else p["S"],
        **_draw_logits(draw, st),
    )
    return p


def _next_token_spec(p: dict) -> NextTokenSpec:
    return NextTokenSpec(
        p["B"],
        p["V"],
        Sampling(p["top_k"], p["top_p"], p["temperature"]),
        p["chunk_size"],
        p["target_len"],
        _sampling_draw(p),
        p["S"],
    )


def _front_end_body(op: str):
    variants = {
        "dtensor_from_parallel_logits_to_logprobs": ["seq_index"],
        "get_logprobs_from_vocab_parallel_logits": ["shard1", "seq_index"],
        "get_next_token_logprobs_from_logits": ["plain", "vocab_parallel_group", "dtensor"],
    }[op]

    def body(draw, st, topology):
        variant = draw(st.sampled_from(variants))
        p = {
            "variant": variant,
            **_next_token_body(
                draw,
                st,
                topology,
                even_vocab=variant == "vocab_parallel_group",
                short_target=variant in ("plain", "vocab_parallel_group"),
            ),
        }
        if op == "get_next_token_logprobs_from_logits":
            p["chunk_size"] = None  # the dispatcher takes no chunk size
        permuted = variant == "seq_index" or (variant == "dtensor" and draw(st.booleans()))
        p["permutation"] = "random" if permuted and topology[1] > 1 else None  # seed: only for CP-sharded logits
        return p

    return body


def _front_end_case(op: str):
    def case(p: dict) -> Case:
        return front_end_case(FrontEndSpec(op, p["variant"], _next_token_spec(p), p["permutation"]))

    return case


def _gather_body(draw, st, topology):
    tp_group = draw(st.sampled_from(["tp", "none"]))
    p = {"tp_group": tp_group, **_draw_sizes(draw, st, topology, False, False), "K": draw(st.integers(1, 6))}
    return {**p, **_draw_logits(draw, st, neg_inf=True)}


def _distill_body(draw, st, topology):
    path = draw(st.sampled_from(["group", "plain"]))
    p = {"path": path, **_draw_sizes(draw, st, topology, False, path == "group")}
    p.update(
        K=draw(st.integers(1, min(6, p["V"]))),
        zero_outside_topk=draw(st.booleans()),
        calculate_entropy=draw(st.booleans()),
        scale=draw(st.sampled_from([3.0, 300.0])),
        ties=draw(st.booleans()),
    )
    return p


def _hidden_body(draw, st, topology):
    dp, cp, tp = topology
    unit = 1 if cp == 1 else 2 * cp
    m = draw(st.integers(2 if cp == 1 else 1, 9 if cp == 1 else 3).filter(lambda m: (unit * m // cp) % tp == 0))
    s = unit * m
    return {
        "B": dp * draw(st.integers(1, 2)),
        "S": s,
        "H": draw(st.integers(1, 8)),
        "V": draw(st.integers(3, 40)),
        "chunk_size": _chunk(draw, st),
        "target_len": draw(st.integers(2, s)),
        "scale": draw(st.sampled_from([1.0, 3.0])),
        "masked": draw(st.sampled_from([0.0, 0.2])),
    }


def _packed_body(draw, st, topology):
    cp, tp = topology[1], topology[2]
    padded = [2 * cp * draw(st.integers(1, 3)) for _ in range(draw(st.integers(1, 3)))]
    real = [draw(st.integers(1, n)) for n in padded]
    p = {
        "padded": padded,
        "real": real,
        "unpacked_seqlen": draw(st.integers(2, max(padded) + 3)),
        "chunk_size": _chunk(draw, st),
        "pre_rolled": draw(st.booleans()),
        **_draw_sampling(draw, st),
    }
    if _filtering(p) and (sum(padded) // cp) % tp:  # the all-to-all needs the local rows to split over TP
        p.update(top_k=None, top_p=1.0)
    p["V"] = draw(st.integers(3, 40).filter(lambda v: not _filtering(p) or v % tp == 0))
    return {**p, **_draw_logits(draw, st)}


def _packed_case(p: dict) -> Case:
    return packed_case(
        PackedSpec(
            tuple(p["padded"]),
            tuple(p["real"]),
            p["V"],
            p["unpacked_seqlen"],
            Sampling(p["top_k"], p["top_p"], p["temperature"]),
            p["chunk_size"],
            p["pre_rolled"],
            _sampling_draw(p),
        )
    )


def fuzz_spaces() -> list[FuzzSpace]:
    tp1 = lambda t: t.tp == 1  # noqa: E731
    front_ends = (
        "dtensor_from_parallel_logits_to_logprobs",
        "get_logprobs_from_vocab_parallel_logits",
        "get_next_token_logprobs_from_logits",
    )
    return [
        FuzzSpace(
            OP + "_get_tokens_on_this_cp_rank",
            _space(lambda t: t.tp == 1 and t.dp == 1, _tokens_body),
            lambda p: tokens_case(TokensSpec(tuple(p["shape"]), p["seq_dim"], p["kind"])),
        ),
        *[
            FuzzSpace(
                OP + name,
                _space(tp1, _all_gather_body),
                lambda p, name=name: all_gather_case(
                    AllGatherSpec(name, tuple(p["shape"]), p["seq_dim"], p["upstream"])
                ),
            )
            for name in ("allgather_cp_sharded_tensor", "AllGatherCPTensor")
        ],
        FuzzSpace(
            OP + "from_parallel_logits_to_logprobs",
            _space(lambda t: True, _next_token_body),
            lambda p: next_token_case(_next_token_spec(p)),
        ),
        *[FuzzSpace(OP + op, _space(lambda t: True, _front_end_body(op)), _front_end_case(op)) for op in front_ends],
        FuzzSpace(
            OP + "gather_logits_at_global_indices",
            _space(lambda t: True, _gather_body),
            lambda p: gather_case(GatherSpec(p["B"], p["V"], p["K"], p["tp_group"], _draw(p), p["S"])),
        ),
        FuzzSpace(
            OP + "get_distillation_topk_logprobs_from_logits",
            _space(lambda t: True, _distill_body),
            lambda p: distillation_case(
                DistillSpec(
                    p["B"],
                    p["V"],
                    p["K"],
                    p["zero_outside_topk"],
                    p["calculate_entropy"],
                    p["path"],
                    Draw(scale=p["scale"], ties=p["ties"]),
                    p["S"],
                )
            ),
        ),
        FuzzSpace(
            OP + "from_parallel_hidden_states_to_logprobs",
            _space(lambda t: True, _hidden_body),
            lambda p: hidden_states_case(
                HiddenSpec(p["B"], p["H"], p["V"], p["chunk_size"], p["target_len"], p["scale"], p["masked"], p["S"])
            ),
        ),
        FuzzSpace(
            OP + "from_parallel_logits_to_logprobs_packed_sequences",
            _space(lambda t: t.dp == 1, _packed_body),
            _packed_case,
        ),
    ]
