"""Suite for nemo_rl.distributed.model_utils: vocab-parallel (TP) log-probs and friends.

Layouts (suites/_model_utils_inputs.py): logits [B, S, V] sharded on the batch over DP and on the vocab over TP
(torch.chunk sizes: V not divisible by TP gives uneven shards); targets sharded over DP, replicated over TP;
TP-all-reduced outputs replicated over TP.  Sequence-parallel hidden states [S, B, H] are sharded on S over TP
and B over DP; the output weight [V, H] on V over TP, replicated over DP: its gradient is summed over DP in the
case (as DDP does), so every topology checks it.  No context parallelism here (cp_group None everywhere; the CP
axis is suites/model_utils_cp.py).

Each op's cases come from a spec (a frozen dataclass naming the case) and a factory `<op>_case(spec)`.  Every
case that communicates declares its exact per-rank collectives (suites/_model_utils_comm.py); properties and
output checks beyond the golden are in suites/_model_utils_checks.py, the benchmarks in
suites/_model_utils_bench.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace

import torch

from shardcheck import REPLICATED, BadInput, Case, FuzzSpace, GradSum, Topology, ours, seed
from shardcheck.reference import model_utils as ref
from shardcheck.suites._model_utils_bench import bench_cases  # noqa: F401  (the suite's benchmarks)
from shardcheck.suites._model_utils_checks import (
    DOC,
    any_tied_survivor,
    chunked_equals_unchunked,
    cited,
    combine,
    entropy_nonpositive,
    survivors_sum_to_1,
    topk_ids_valid,
    topk_values_exact,
)
from shardcheck.suites._model_utils_comm import (
    NO_COMM,
    all_to_all_comm,
    contract,
    cross_entropy_comm,
    distillation_comm,
    entropy_comm,
    gather_logits_comm,
    hidden_comm,
    logprob_comm,
    next_token_comm,
    sampling_comm,
    softmax_comm,
    topk_comm,
)
from shardcheck.suites._model_utils_inputs import (
    BATCH,
    LOGITS,
    NO_SAMPLING,
    ROWS,
    ROWS_VOCAB,
    SEQ_HIDDEN,
    WEIGHT,
    Draw,
    Sampling,
    all_to_all_fits,
    batch_divides,
    distill_inputs,
    dtensor,
    even_vocab,
    gather_inputs,
    hidden_inputs,
    hidden_logits,
    logits_and_target,
    make_logits,
    sampling_inputs,
    sampling_params,
    vocab_range,
)

FAMILY = "model_utils"
OP = FAMILY + "."


@dataclass(frozen=True)
class Shape:
    """Logits [B, S, V] and how they are drawn.  V = 37 and 33 give uneven vocab shards at TP 2 and 4."""

    b: int
    s: int
    v: int
    draw: Draw = Draw()

    @property
    def case_id(self) -> str:
        return f"b{self.b}s{self.s}v{self.v}{self.draw.tag}"

    @property
    def params(self) -> dict:
        return {"B": self.b, "S": self.s, "V": self.v, **self.draw.extra}

    def unmasked(self) -> Shape:
        """The same logits for ops without targets."""
        return replace(self, draw=replace(self.draw, masked=0.0))


SHAPES = (
    Shape(4, 8, 32),
    Shape(4, 6, 37, Draw(masked=0.3)),
    Shape(2, 5, 33, Draw(scale=300.0, masked=0.2)),  # huge logits: stability (x100 of the usual scale)
    Shape(4, 4, 24, Draw(ties=True, masked=0.2)),
    Shape(4, 7, 40, Draw(neg_inf=0.2, masked=0.2)),
)
QUICK_SHAPES = (SHAPES[1], SHAPES[2])


# ---- softmax, log-probs, cross entropy -------------------------------------------------------

SOFTMAX_REFERENCES = {"_compute_distributed_log_softmax": ref.log_softmax, "_compute_distributed_softmax": ref.softmax}


def softmax_case(op: str, shape: Shape) -> Case:
    shape, reference = shape.unmasked(), SOFTMAX_REFERENCES[op]
    return Case(
        op=OP + op,
        case_id=shape.case_id,
        params=shape.params,
        make_inputs=lambda gen: {"logits": shape.draw.logits(gen, (shape.b, shape.s, shape.v))},
        reference=lambda x: reference(x["logits"]),
        run=lambda impl, ctx, x: getattr(impl, op)(x["logits"], ctx.group("tp")),
        input_layouts={"logits": LOGITS},
        output_layouts=(LOGITS,),
        supports=batch_divides(shape.b),
        comm=contract(lambda ctx: (softmax_comm(ctx), {})),
    )


LOGPROB_IO = dict(input_layouts={"logits": LOGITS, "target": BATCH}, output_layouts=(BATCH,))


def logprob_case(shape: Shape, chunk: int | None = None) -> Case:
    """DistributedLogprob (chunk None) or ChunkedDistributedLogprob (chunk 3 does not divide S; 64 > S: one chunk)."""

    def run(impl, ctx, x):
        if chunk is None:
            return impl.DistributedLogprob.apply(x["logits"], x["target"], *vocab_range(ctx), ctx.group("tp"))
        return impl.ChunkedDistributedLogprob.apply(x["logits"], x["target"], *vocab_range(ctx), chunk, ctx.group("tp"))

    return Case(
        op=OP + ("DistributedLogprob" if chunk is None else "ChunkedDistributedLogprob"),
        case_id=shape.case_id + ("" if chunk is None else f"-chunk{chunk}"),
        params=shape.params if chunk is None else {**shape.params, "chunk_size": chunk},
        make_inputs=lambda gen: logits_and_target(gen, shape.b, shape.s, shape.v, shape.draw),
        reference=lambda x: ref.logprob(x["logits"], x["target"]),
        run=run,
        grad_inputs=("logits",),
        supports=batch_divides(shape.b),
        comm=contract(lambda ctx: logprob_comm(ctx, shape.s, chunk)),
        **LOGPROB_IO,
    )


def next_token_case(shape: Shape, chunk: int | None) -> Case:
    """from_parallel_logits_to_logprobs without sampling: the target unshifted, the result [B, S-1]."""
    return Case(
        op=OP + "from_parallel_logits_to_logprobs",
        case_id=f"{shape.case_id}-chunk{chunk}",
        params={**shape.params, "chunk_size": chunk},
        make_inputs=lambda gen: logits_and_target(gen, shape.b, shape.s, shape.v, shape.draw, shift=True),
        reference=lambda x: ref.next_token_logprobs(x["logits"], x["target"]),
        run=lambda impl, ctx, x: impl.from_parallel_logits_to_logprobs(
            x["logits"], x["target"], *vocab_range(ctx), ctx.group("tp"), chunk_size=chunk
        ),
        grad_inputs=("logits",),
        supports=batch_divides(shape.b),
        comm=contract(lambda ctx: logprob_comm(ctx, shape.s, chunk)),
        **LOGPROB_IO,
    )


def inference_only_case(shape: Shape, chunk: int | None) -> Case:
    """inference_only=True: the same values, forward only."""

    def run(impl, ctx, x):
        if chunk is None:
            return impl.DistributedLogprob.apply(x["logits"], x["target"], *vocab_range(ctx), ctx.group("tp"), True)
        return impl.ChunkedDistributedLogprob.apply(
            x["logits"], x["target"], *vocab_range(ctx), chunk, ctx.group("tp"), True
        )

    return Case(
        op=OP + ("DistributedLogprob" if chunk is None else "ChunkedDistributedLogprob"),
        case_id=f"{shape.case_id}-inference_only",
        params={**shape.params, "inference_only": True},
        make_inputs=lambda gen: logits_and_target(gen, shape.b, shape.s, shape.v, shape.draw),
        reference=lambda x: ref.logprob(x["logits"], x["target"]),
        run=run,
        supports=batch_divides(shape.b),
        comm=contract(lambda ctx: logprob_comm(ctx, shape.s, chunk, grad=False)),
        **LOGPROB_IO,
    )


def logprob_cases(shapes, quick: bool) -> list[Case]:
    chunks = (3,) if quick else (3, 1, 64)
    cases = []
    for shape in shapes:
        cases += [logprob_case(shape)] + [logprob_case(shape, c) for c in chunks]
        cases += [next_token_case(shape, c) for c in (None, chunks[0])]
    return cases + [inference_only_case(shapes[0], None), inference_only_case(shapes[0], 2)]


def cross_entropy_case(shape: Shape) -> Case:
    shape = shape.unmasked()

    def make(gen):  # the target's logits are finite (p > 0: a student -inf there gives H = +inf), except below
        student = shape.draw.logits(gen, (shape.b, shape.s, shape.v))
        huge = shape.draw.scale > 10
        # Huge logits are the student's; the target's stay at the usual scale.  With both huge, q and p can be
        # one-hot at the same id, where q - p is a difference of two probabilities near 1 whose rounding (an ulp of
        # 1) is all there is of the gradient: no budget relative to it can judge it (fuzz: float64, one row, a
        # gradient of 3e-16); and a p tiny in float64 underflows to 0 in float32 (H +inf in one dtype only).
        target = replace(shape.draw, neg_inf=0.0, scale=3.0 if huge else shape.draw.scale).logits(
            gen, (shape.b, shape.s, shape.v)
        )
        if huge:  # the student's -inf go onto the target too (p = 0: those terms count as 0), so the rows stay
            # finite and their gradients are checked; at the usual scale they make H = +inf
            target = target.masked_fill(student.isneginf(), float("-inf"))
        return {"student_logits": student, "target_logits": target}

    return Case(
        op=OP + "DistributedCrossEntropy",
        case_id=shape.case_id,
        params=shape.params,
        make_inputs=make,
        reference=lambda x: ref.cross_entropy(x["student_logits"], x["target_logits"]),
        run=lambda impl, ctx, x: impl.DistributedCrossEntropy.apply(
            x["student_logits"], x["target_logits"], ctx.group("tp")
        ),
        input_layouts={"student_logits": LOGITS, "target_logits": LOGITS},
        output_layouts=(BATCH,),
        grad_inputs=("student_logits",),
        supports=batch_divides(shape.b),
        comm=contract(cross_entropy_comm),
    )


# huge logits with -inf in the student, and there in the target too (p = 0: those terms count as 0)
CROSS_ENTROPY_HUGE_NEG_INF = Shape(2, 5, 33, Draw(scale=300.0, neg_inf=0.2))


def cross_entropy_shape_mismatch_case() -> Case:
    return Case(
        op=OP + "DistributedCrossEntropy",
        case_id="shape-mismatch",
        params={"student": [2, 4, 16], "target": [2, 3, 16]},
        make_inputs=lambda gen: {
            "student_logits": make_logits(gen, (2, 4, 16)),
            "target_logits": make_logits(gen, (2, 3, 16)),
        },
        reference=lambda x: None,
        run=lambda impl, ctx, x: impl.DistributedCrossEntropy.apply(
            x["student_logits"], x["target_logits"], ctx.group("tp")
        ),
        input_layouts={"student_logits": LOGITS, "target_logits": LOGITS},
        dtypes=("float64",),
        bad_input=BadInput("student logits [2, 4, 16] and target logits [2, 3, 16] of different shapes"),
        supports=batch_divides(2),
    )


# ---- all_to_all_vp2sq / all_to_all_sq2vp -----------------------------------------------------

ALL_TO_ALL_LAYOUTS = {"all_to_all_vp2sq": (ROWS_VOCAB, ROWS), "all_to_all_sq2vp": (ROWS, ROWS_VOCAB)}


def all_to_all_case(op: str, rows: int, v: int) -> Case:
    layout_in, layout_out = ALL_TO_ALL_LAYOUTS[op]
    return Case(
        op=OP + op,
        case_id=f"bs{rows}v{v}",
        params={"BS": rows, "V": v},
        make_inputs=lambda gen: {"logits": make_logits(gen, (rows, v))},
        reference=lambda x: x["logits"].clone(),  # a pure layout change: values are untouched
        run=lambda impl, ctx, x: getattr(impl, op)(x["logits"], ctx.group("tp")),
        input_layouts={"logits": layout_in},
        output_layouts=(layout_out,),
        comm=contract(all_to_all_comm),
        supports=lambda t: (rows // t.dp) % t.tp == 0 and v % t.tp == 0,
    )


def all_to_all_bad_input_cases(op: str) -> list[Case]:
    """Sizes TP does not divide (vp2sq splits the rows over TP, sq2vp the vocab) and 3-D logits: no layout is
    documented for them, so the op must raise on every rank."""
    rows, v = (6, 8) if op == "all_to_all_vp2sq" else (8, 6)
    run = lambda impl, ctx, x: getattr(impl, op)(x["logits"], ctx.group("tp"))  # noqa: E731
    return [
        Case(
            op=OP + op,
            case_id=f"bs{rows}v{v}-not-divisible",
            params={"BS": rows, "V": v},
            make_inputs=lambda gen: {"logits": make_logits(gen, (rows, v))},
            reference=lambda x: None,
            run=run,
            dtypes=("float64",),
            supports=lambda t: t.tp == 4 and t.dp == 1,
            bad_input=BadInput(
                f"[{rows}, {v}] logits whose {'rows' if op.endswith('vp2sq') else 'vocab'} TP 4 does not divide"
            ),
        ),
        Case(
            op=OP + op,
            case_id="not-2d",
            params={"shape": [2, 4, 8]},
            make_inputs=lambda gen: {"logits": make_logits(gen, (2, 4, 8))},
            reference=lambda x: None,
            run=run,
            dtypes=("float64",),
            bad_input=BadInput(
                "3-D logits [2, 4, 8] (the op takes [BS, V])", rule=seed("vocab_parallel_logits – [BS, V_local] tensor")
            ),
            supports=lambda t: t.dp == 1,
        ),
    ]


def all_to_all_cases(quick: bool) -> list[Case]:
    sizes = ((24, 48),) if quick else ((16, 32), (24, 48))
    cases = [all_to_all_case(op, rows, v) for rows, v in sizes for op in ALL_TO_ALL_LAYOUTS]
    return cases + [c for op in ALL_TO_ALL_LAYOUTS for c in all_to_all_bad_input_cases(op)]


# ---- DistributedLogprobWithSampling / ChunkedDistributedLogprobWithSampling ------------------
#
# Sampling (top-k/top-p) ops move [B*S, V_local] to [B*S/TP, V] with an all-to-all: they run only where the local
# B*S splits over TP and the vocab shards are even (`supports`).


@dataclass(frozen=True)
class SamplingSpec:
    """Every shape splits B*S over TP 8 and has V divisible by 8.  `chunks`: the chunked op's chunk sizes."""

    b: int
    s: int
    v: int
    sampling: Sampling
    draw: Draw = Draw()
    chunks: tuple[int, ...] = (3,)  # 3 does not divide S

    @property
    def case_id(self) -> str:
        return f"b{self.b}s{self.s}v{self.v}{self.draw.tag}-{self.sampling.tag()}"

    @property
    def params(self) -> dict:
        return {"B": self.b, "S": self.s, "V": self.v, **self.draw.extra, **self.sampling.params()}


SAMPLING_SPECS = (
    SamplingSpec(4, 6, 32, Sampling(top_k=5), chunks=(3, 1, 64)),  # top-k only; 64: a single chunk
    SamplingSpec(4, 6, 32, Sampling(top_p=0.8), Draw(masked=0.2)),  # top-p only
    SamplingSpec(2, 8, 48, Sampling(top_k=5, top_p=0.9), Draw(ties=True, masked=0.2)),  # both; ties at the k-th logit
    SamplingSpec(2, 8, 48, Sampling(top_k=0)),  # neither (top_k <= 0 disables)
    SamplingSpec(2, 4, 16, Sampling(top_k=3, top_p=0.7), Draw(scale=300.0)),  # huge logits
    # only one of the tied maxima survives, any of them (forward only: which one decides the gradient)
    SamplingSpec(2, 8, 48, Sampling(top_p=1e-6), Draw(ties=True, tie_choice=True)),
)
QUICK_SAMPLING = (replace(SAMPLING_SPECS[2], chunks=(3,)), SAMPLING_SPECS[5])


def sampling_case(spec: SamplingSpec, chunk: int | None = None) -> Case:
    """DistributedLogprobWithSampling (chunk None) or its chunked twin; properties: the survivors' probabilities
    sum to 1, and the chunked op equals the unchunked one."""
    smp = spec.sampling

    def call(impl, ctx, logits, target, chunk, inference_only=False):
        if chunk is None:
            return impl.DistributedLogprobWithSampling.apply(
                logits, target, ctx.group("tp"), smp.top_k, smp.top_p, inference_only
            )
        return impl.ChunkedDistributedLogprobWithSampling.apply(
            logits, target, ctx.group("tp"), smp.top_k, smp.top_p, chunk, inference_only
        )

    properties = survivors_sum_to_1(
        lambda impl, ctx, logits, t: call(impl, ctx, logits, t, chunk, inference_only=True), spec.v
    )
    if chunk is not None:
        properties = combine(
            properties,
            chunked_equals_unchunked(
                lambda impl, ctx, x: call(impl, ctx, x["logits"], x["target"], None, inference_only=True)
            ),
        )
    forward_only = (
        dict(grad_inputs=(), output_checks={"out": any_tied_survivor(smp)})
        if spec.draw.tie_choice
        else dict(grad_inputs=("logits",))
    )
    return Case(
        op=OP + ("DistributedLogprobWithSampling" if chunk is None else "ChunkedDistributedLogprobWithSampling"),
        case_id=spec.case_id + ("" if chunk is None else f"-chunk{chunk}"),
        params=spec.params if chunk is None else {**spec.params, "chunk_size": chunk},
        make_inputs=lambda gen: sampling_inputs(gen, spec.b, spec.s, spec.v, smp, spec.draw),
        reference=lambda x: ref.sampling_logprob(x["logits"], x["target"], smp.top_k, smp.top_p),
        run=lambda impl, ctx, x: call(impl, ctx, x["logits"], x["target"], chunk),
        properties=properties,
        supports=all_to_all_fits(spec.b, spec.s, spec.v),
        comm=contract(lambda ctx: sampling_comm(ctx, chunk, ctx.dtype.itemsize)),
        **LOGPROB_IO,
        **forward_only,
    )


def sampling_rows_not_divisible_case(op: str) -> Case:
    """B*S = 3 rows do not split over TP 2, 4, 8: the op raises, or pads the rows and returns the same log-probs
    (the result [B, S] does not depend on how the rows were laid out), gradients included."""
    smp = Sampling(top_k=4)

    def run(impl, ctx, x):
        if op == "DistributedLogprobWithSampling":
            return impl.DistributedLogprobWithSampling.apply(
                x["logits"], x["target"], ctx.group("tp"), smp.top_k, smp.top_p
            )
        return impl.ChunkedDistributedLogprobWithSampling.apply(
            x["logits"], x["target"], ctx.group("tp"), smp.top_k, smp.top_p, 2
        )

    return Case(
        op=OP + op,
        case_id="b1s3v16-bs-not-divisible",
        params={"B": 1, "S": 3, "V": 16, "top_k": 4},
        make_inputs=lambda gen: sampling_inputs(gen, 1, 3, 16, smp),
        reference=lambda x: ref.sampling_logprob(x["logits"], x["target"], smp.top_k, smp.top_p),
        run=run,
        grad_inputs=("logits",),
        dtypes=("float64",),
        supports=lambda t: t.dp == 1 and 3 % t.tp != 0,
        bad_input=BadInput(
            "B·S = 3 rows that TP does not divide",
            interpretation="the rows padded to a multiple of TP: the same [B, S] log-probs",
        ),
        **LOGPROB_IO,
    )


def sampling_cases(quick: bool) -> list[Case]:
    cases = []
    for spec in QUICK_SAMPLING if quick else SAMPLING_SPECS:
        cases += [sampling_case(spec)] + [sampling_case(spec, chunk) for chunk in spec.chunks]
    return cases + [
        sampling_rows_not_divisible_case(op)
        for op in ("DistributedLogprobWithSampling", "ChunkedDistributedLogprobWithSampling")
    ]


# ---- ChunkedDistributedGatherLogprob, gather_logits_at_global_indices ------------------------


@dataclass(frozen=True)
class GatherSpec:
    """K global ids per position (duplicates included).  `tp_group` "none": every rank holds the full vocab."""

    b: int
    s: int
    v: int
    k: int
    draw: Draw = Draw()
    chunk: int | None = None
    tp_group: str = "tp"

    @property
    def case_id(self) -> str:
        return f"b{self.b}s{self.s}v{self.v}{self.draw.tag}-k{self.k}-dup"

    @property
    def params(self) -> dict:
        return {"B": self.b, "S": self.s, "V": self.v, "K": self.k, "duplicates": True, **self.draw.extra}


# V = 37/33: uneven shards; V = 20 leaves TP rank 7 of 8 an empty shard.
GATHER_LOGPROB_SPECS = (
    GatherSpec(4, 6, 37, 4, Draw(masked=0.2), chunk=4),  # chunk 4 does not divide S
    GatherSpec(2, 8, 48, 6, chunk=3),
    GatherSpec(2, 5, 33, 3, Draw(scale=300.0), chunk=2),  # huge logits
    GatherSpec(4, 4, 24, 5, Draw(ties=True, neg_inf=0.2), chunk=1),  # ids on -inf logits: logprob -inf
    GatherSpec(2, 8, 20, 5, chunk=64),  # a single chunk
    # V = 1: every id repeats and the softmax is exactly 1, so the gradient is exactly 0 (TP ranks > 0: empty shards)
    GatherSpec(2, 4, 1, 4, chunk=3),
    GatherSpec(2, 4, 24, 3, Draw(ids_int32=True), chunk=3),  # int32 ids (our rule: the seed states no index dtype)
)
QUICK_GATHER_LOGPROB = (GATHER_LOGPROB_SPECS[0], GATHER_LOGPROB_SPECS[4])


def gather_logprob_case(spec: GatherSpec) -> Case:
    def call(impl, ctx, x, chunk, inference_only=False):
        return impl.ChunkedDistributedGatherLogprob.apply(
            x["logits"], x["indices"], *vocab_range(ctx), chunk, ctx.group("tp"), inference_only
        )

    return Case(
        op=OP + "ChunkedDistributedGatherLogprob",
        case_id=f"{spec.case_id}-chunk{spec.chunk}",
        params={**spec.params, "chunk_size": spec.chunk},
        make_inputs=lambda gen: gather_inputs(gen, spec.b, spec.s, spec.v, spec.k, spec.draw),
        reference=lambda x: ref.gather_logprob(x["logits"], x["indices"]),
        run=lambda impl, ctx, x: call(impl, ctx, x, spec.chunk),
        input_layouts={"logits": LOGITS, "indices": BATCH},
        output_layouts=(BATCH,),
        grad_inputs=("logits",),
        comm=contract(lambda ctx: logprob_comm(ctx, spec.s, spec.chunk, k=spec.k)),
        properties=chunked_equals_unchunked(lambda impl, ctx, x: call(impl, ctx, x, spec.s, True)),
        supports=batch_divides(spec.b),
    )


GATHER_LOGITS_SPECS = (
    GatherSpec(4, 6, 37, 5, Draw(masked=0.2)),
    GatherSpec(2, 8, 48, 4, Draw(scale=300.0), chunk=3),
    GatherSpec(4, 6, 32, 5, Draw(masked=0.2), tp_group="none"),
    # ids on -inf logits: the owner's -inf must come through the TP sum, with no NaN from a non-owner's -inf x 0
    GatherSpec(4, 6, 37, 5, Draw(neg_inf=0.3)),
    # V = 6: TP rank 3 of 4 holds an empty shard; its zeros must still carry the gradient (an empty one)
    GatherSpec(2, 4, 6, 3),
    GatherSpec(2, 4, 24, 3, Draw(ids_int32=True)),  # int32 ids (our rule: the seed states no index dtype)
)
QUICK_GATHER_LOGITS = (GATHER_LOGITS_SPECS[0], GATHER_LOGITS_SPECS[2], GATHER_LOGITS_SPECS[3])


def gather_logits_case(spec: GatherSpec) -> Case:
    """TP-sharded logits, or tp_group=None: every rank holds the full vocab (logits replicated over TP)."""
    sharded = spec.tp_group == "tp"

    def run(impl, ctx, x):
        if sharded:
            start, end = vocab_range(ctx)
            return impl.gather_logits_at_global_indices(
                x["logits"],
                x["indices"],
                ctx.group("tp"),
                None,
                vocab_start_index=start,
                vocab_end_index=end,
                chunk_size=spec.chunk,
            )
        return impl.gather_logits_at_global_indices(
            x["logits"], x["indices"], None, None, vocab_start_index=0, vocab_end_index=spec.v
        )

    return Case(
        op=OP + "gather_logits_at_global_indices",
        case_id=f"{spec.case_id}-tp_group_{spec.tp_group}" + (f"-chunk{spec.chunk}" if spec.chunk else ""),
        params={**spec.params, "tp_group": spec.tp_group, "chunk_size": spec.chunk},
        make_inputs=lambda gen: gather_inputs(gen, spec.b, spec.s, spec.v, spec.k, spec.draw),
        reference=lambda x: ref.gather_logits(x["logits"], x["indices"]),
        run=run,
        comm=contract(lambda ctx: gather_logits_comm(ctx, spec.k)) if sharded else NO_COMM,
        input_layouts={"logits": LOGITS if sharded else BATCH, "indices": BATCH},
        output_layouts=(BATCH,),
        grad_inputs=("logits",),
        supports=batch_divides(spec.b),
    )


# ---- distributed_vocab_topk ------------------------------------------------------------------


@dataclass(frozen=True)
class TopkSpec:
    b: int
    s: int
    v: int
    k: int
    draw: Draw = Draw()
    chunk: int | None = None

    @property
    def case_id(self) -> str:
        return f"b{self.b}s{self.s}v{self.v}{self.draw.tag}-k{self.k}" + (f"-chunk{self.chunk}" if self.chunk else "")

    @property
    def params(self) -> dict:
        return {"B": self.b, "S": self.s, "V": self.v, "k": self.k, "chunk_size": self.chunk, **self.draw.extra}


TOPK_SPECS = (
    TopkSpec(4, 6, 16, 10, Draw(ties=True)),  # k > V_local from TP 2 on; ties at the boundary
    TopkSpec(2, 8, 16, 16, chunk=3),  # k = V; chunk 3 does not divide S
    TopkSpec(2, 8, 48, 5, Draw(ties=True), chunk=3),  # ties at the k-th value
    TopkSpec(2, 5, 37, 4, Draw(scale=300.0)),  # uneven shards, huge logits
    TopkSpec(2, 4, 6, 6, Draw(ties=True)),  # k = V with empty shards at TP 4 and 8
    TopkSpec(2, 4, 20, 20, Draw(neg_inf=0.3), chunk=2),  # -inf among the top k (ties of -inf); TP 8: an empty shard
)
QUICK_TOPK = (TOPK_SPECS[0], TOPK_SPECS[4])


def topk_case(spec: TopkSpec) -> Case:
    """Values exactly torch.topk's; with ties, any ids whose logits equal the values (output checks)."""

    def run(impl, ctx, x):
        start, end = vocab_range(ctx)
        return impl.distributed_vocab_topk(
            x["logits"], spec.k, ctx.group("tp"), vocab_start_index=start, vocab_end_index=end, chunk_size=spec.chunk
        )

    return Case(
        op=OP + "distributed_vocab_topk",
        case_id=spec.case_id,
        params=spec.params,
        make_inputs=lambda gen: {"logits": spec.draw.logits(gen, (spec.b, spec.s, spec.v))},
        reference=lambda x: ref.vocab_topk(x["logits"], spec.k),
        run=run,
        input_layouts={"logits": LOGITS},
        output_layouts=(BATCH, BATCH),
        output_names=("values", "ids"),
        output_checks={"values": topk_values_exact, "ids": topk_ids_valid},
        supports=batch_divides(spec.b),
        comm=contract(lambda ctx: topk_comm(ctx, spec.s, spec.k, spec.chunk)),
    )


# ---- get_distillation_topk_logprobs_from_logits ----------------------------------------------


@dataclass(frozen=True)
class DistillSpec:
    """`path`: "group" (vocab_parallel_rank and group), "dtensor" (DTensor student logits), "plain" (full vocab)."""

    b: int
    s: int
    v: int
    k: int
    zero_outside_topk: bool
    calculate_entropy: bool
    path: str = "group"
    draw: Draw = Draw()

    @property
    def case_id(self) -> str:
        return (
            f"b{self.b}s{self.s}v{self.v}{self.draw.tag}-k{self.k}-zero_outside_{self.zero_outside_topk}"
            f"-entropy_{self.calculate_entropy}-{self.path}"
        )

    @property
    def params(self) -> dict:
        return {
            "B": self.b,
            "S": self.s,
            "V": self.v,
            "K": self.k,
            "zero_outside_topk": self.zero_outside_topk,
            "calculate_entropy": self.calculate_entropy,
            "path": self.path,
            **self.draw.extra,
        }


DISTILL_SPECS = (
    *(DistillSpec(2, 8, 32, 4, zero, entropy) for zero in (False, True) for entropy in (False, True)),
    DistillSpec(2, 8, 32, 4, False, True, draw=Draw(scale=300.0)),  # huge logits
    DistillSpec(4, 6, 37, 5, True, True, "dtensor"),  # uneven shards through the DTensor
    DistillSpec(4, 6, 24, 5, False, True, "plain", Draw(ties=True)),  # full vocab on every rank
    DistillSpec(4, 6, 24, 5, False, True, draw=Draw(neg_inf=0.3)),  # -inf among the K ids and the vocab
    DistillSpec(4, 6, 24, 5, True, False, draw=Draw(neg_inf=0.3)),
)
QUICK_DISTILL = (DISTILL_SPECS[1], DISTILL_SPECS[3])


def distillation_case(spec: DistillSpec) -> Case:
    def run(impl, ctx, x):
        student, kw = x["student_logits"], {}
        if spec.path == "group":
            kw = dict(vocab_parallel_rank=ctx.rank("tp"), vocab_parallel_group=ctx.group("tp"))
        elif spec.path == "dtensor":
            student = dtensor(ctx, student, "student_logits", LOGITS)
        return impl.get_distillation_topk_logprobs_from_logits(
            student,
            x["teacher_topk_logits"],
            x["teacher_topk_indices"],
            spec.zero_outside_topk,
            spec.calculate_entropy,
            **kw,
        )

    def reference(x):  # H_all None without calculate_entropy: the op must return None too
        return ref.distillation_topk_logprobs(
            x["student_logits"],
            x["teacher_topk_logits"],
            x["teacher_topk_indices"],
            spec.zero_outside_topk,
            spec.calculate_entropy,
        )

    return Case(
        op=OP + "get_distillation_topk_logprobs_from_logits",
        case_id=spec.case_id,
        params=spec.params,
        make_inputs=lambda gen: distill_inputs(gen, spec.b, spec.s, spec.v, spec.k, spec.draw),
        reference=reference,
        run=run,
        input_layouts={
            "student_logits": BATCH if spec.path == "plain" else LOGITS,
            "teacher_topk_logits": BATCH,
            "teacher_topk_indices": BATCH,
        },
        output_layouts=(BATCH, BATCH, BATCH if spec.calculate_entropy else REPLICATED),
        output_names=("student", "teacher", "H_all"),
        grad_inputs=("student_logits", "teacher_topk_logits"),
        comm=NO_COMM
        if spec.path == "plain"
        else contract(
            lambda ctx: distillation_comm(ctx, spec.s, spec.k, spec.zero_outside_topk, spec.calculate_entropy)
        ),
        supports=even_vocab(spec.b, spec.v) if spec.path == "group" else batch_divides(spec.b),
    )


# ---- ChunkedDistributedEntropy ---------------------------------------------------------------


@dataclass(frozen=True)
class EntropySpec:
    b: int
    s: int
    v: int
    chunk: int
    draw: Draw = Draw()

    @property
    def case_id(self) -> str:
        return f"b{self.b}s{self.s}v{self.v}{self.draw.tag}-chunk{self.chunk}"

    @property
    def params(self) -> dict:
        return {"B": self.b, "S": self.s, "V": self.v, "chunk_size": self.chunk, **self.draw.extra}


ENTROPY_SPECS = (
    EntropySpec(4, 6, 37, 4),  # uneven shards; chunk 4 does not divide S
    EntropySpec(2, 8, 48, 1),
    EntropySpec(2, 5, 33, 2, Draw(huge_close_top=True)),  # huge logits
    # p = 0 terms apart from the single chunk, so that a finding on either names its own trigger
    EntropySpec(4, 7, 40, 3, Draw(neg_inf=0.2)),  # p = 0 terms; chunk 3 does not divide S
    EntropySpec(4, 8, 20, 64, Draw(ties=True)),  # TP 8: an empty shard; a single chunk
)
QUICK_ENTROPY = (ENTROPY_SPECS[0], ENTROPY_SPECS[2])


def entropy_case(spec: EntropySpec) -> Case:
    return Case(
        op=OP + "ChunkedDistributedEntropy",
        case_id=spec.case_id,
        params=spec.params,
        make_inputs=lambda gen: {"logits": spec.draw.logits(gen, (spec.b, spec.s, spec.v))},
        reference=lambda x: ref.entropy(x["logits"]),
        run=lambda impl, ctx, x: impl.ChunkedDistributedEntropy.apply(x["logits"], spec.chunk, ctx.group("tp")),
        input_layouts={"logits": LOGITS},
        output_layouts=(BATCH,),
        grad_inputs=("logits",),
        comm=contract(lambda ctx: entropy_comm(ctx, spec.s, spec.chunk)),
        properties=combine(
            entropy_nonpositive,
            chunked_equals_unchunked(
                lambda impl, ctx, x: impl.ChunkedDistributedEntropy.apply(x["logits"], spec.s, ctx.group("tp"), True)
            ),
        ),
        supports=batch_divides(spec.b),
    )


# ---- hidden states -> log-probs ----------------------------------------------------------------


@dataclass(frozen=True)
class HiddenSpec:
    """Hidden states [S, B, H] and an output weight [V, H] (S divisible by 8 runs on TP 8; V = 37: uneven weight
    shards).  `via`: how from_parallel_hidden_states_to_logprobs gets the weight (None: the chunked Function)."""

    s: int
    b: int
    h: int
    v: int
    chunk: int | None
    via: str | None = None  # "output_weight" | "layer_module" | "layer_tensor"
    scale: float = 1.0
    masked: float = 0.0

    @property
    def case_id(self) -> str:
        extra = "".join(f"-{k}{x}" for k, x in self.extra.items())
        return f"s{self.s}b{self.b}h{self.h}v{self.v}{extra}-chunk{self.chunk}" + (f"-{self.via}" if self.via else "")

    @property
    def extra(self) -> dict:
        """scale and masked where they differ from the defaults (1.0, 0.0)."""
        return {k: x for k, x, default in (("scale", self.scale, 1.0), ("masked", self.masked, 0.0)) if x != default}

    @property
    def params(self) -> dict:
        via = {"weight_via": self.via} if self.via else {}
        return {"S": self.s, "B": self.b, "H": self.h, "V": self.v, "chunk_size": self.chunk, **via, **self.extra}


CHUNKED_HIDDEN_SPECS = (
    HiddenSpec(8, 2, 8, 32, 3),
    HiddenSpec(4, 4, 6, 37, 64, masked=0.2),
    HiddenSpec(8, 2, 8, 24, 2, scale=10.0),
    HiddenSpec(4, 2, 5, 6, 3),
)  # V = 6: TP rank 3 of 4 holds an empty weight shard
HIDDEN_SPECS = (
    HiddenSpec(8, 2, 8, 32, None, "output_weight"),
    HiddenSpec(8, 2, 8, 32, 3, "layer_module"),
    HiddenSpec(4, 4, 6, 37, 3, "layer_tensor", masked=0.2),
)
HIDDEN_IO = dict(
    input_layouts={"hidden": SEQ_HIDDEN, "weight": WEIGHT, "target": BATCH},
    output_layouts=(BATCH,),
    grad_inputs=("hidden", "weight"),
)


def _input_dtype(ctx) -> torch.dtype:
    return ctx.dtype  # the projection runs in the input dtype: chunking may round it differently


def hidden_states_case(spec: HiddenSpec) -> Case:
    """ChunkedDistributedHiddenStatesToLogprobs (spec.via None; target already shifted) or
    from_parallel_hidden_states_to_logprobs with the weight passed `spec.via`."""

    def call(impl, ctx, x, chunk, inference_only=False):
        weight = GradSum.apply(x["weight"], (ctx.group("dp"),))  # DDP's sum of the weight gradient over DP
        if spec.via is None:
            return impl.ChunkedDistributedHiddenStatesToLogprobs.apply(
                x["hidden"], x["target"], weight, *ctx.local_range("weight", 0), chunk, ctx.group("tp"), inference_only
            )
        layer, out_weight = {
            "output_weight": (None, weight),
            "layer_module": (SimpleNamespace(weight=weight), None),
            "layer_tensor": (weight, None),
        }[spec.via]
        return impl.from_parallel_hidden_states_to_logprobs(
            x["hidden"],
            layer,
            out_weight,
            False,
            x["target"],
            *ctx.local_range("weight", 0),
            ctx.group("tp"),
            inference_only=inference_only,
            cp_group=None,
            chunk_size=chunk,
        )

    if spec.via is None:
        op, reference = "ChunkedDistributedHiddenStatesToLogprobs", lambda x: ref.logprob(hidden_logits(x), x["target"])
        unchunked = spec.s
    else:
        op, unchunked = "from_parallel_hidden_states_to_logprobs", None
        reference = lambda x: ref.hidden_states_to_logprobs(x["hidden"], x["weight"], x["target"])  # noqa: E731
    return Case(
        op=OP + op,
        case_id=spec.case_id,
        params=spec.params,
        make_inputs=lambda gen: hidden_inputs(gen, spec.s, spec.b, spec.h, spec.v, spec.scale, spec.masked),
        reference=reference,
        run=lambda impl, ctx, x: call(impl, ctx, x, spec.chunk),
        properties=None
        if spec.chunk is None
        else chunked_equals_unchunked(
            lambda impl, ctx, x: call(impl, ctx, x, unchunked, inference_only=True), eps_of=_input_dtype
        ),
        comm=contract(lambda ctx: hidden_comm(ctx, spec.s, spec.chunk)),
        supports=lambda t: spec.s % t.tp == 0 and spec.b % t.dp == 0,
        **HIDDEN_IO,
    )


def hidden_states_cases(quick: bool) -> list[Case]:
    specs = CHUNKED_HIDDEN_SPECS[:1] + HIDDEN_SPECS[1:2] if quick else CHUNKED_HIDDEN_SPECS + HIDDEN_SPECS
    return [hidden_states_case(s) for s in specs]


# ---- from_parallel_logits_to_logprobs with sampling_params, and the front ends over it -------


def next_token_reference(smp: Sampling):
    if smp == NO_SAMPLING:
        return lambda x: ref.next_token_logprobs(x["logits"], x["target"])
    return lambda x: ref.next_token_sampling_logprobs(x["logits"], x["target"], smp.top_k, smp.top_p, smp.temperature)


def next_token_supports(b: int, s: int, v: int, smp: Sampling, even: bool = False):
    if smp.filtering:
        return all_to_all_fits(b, s, v)
    return even_vocab(b, v) if even else batch_divides(b)


@dataclass(frozen=True)
class NextTokenSpec:
    b: int
    s: int
    v: int
    sampling: Sampling
    chunk: int | None = None
    draw: Draw = Draw()

    @property
    def case_id(self) -> str:
        return f"b{self.b}s{self.s}v{self.v}{self.draw.tag}-{self.sampling.tag()}"

    @property
    def params(self) -> dict:
        return {
            "B": self.b,
            "S": self.s,
            "V": self.v,
            "chunk_size": self.chunk,
            **self.draw.extra,
            **self.sampling.params(),
        }

    def inputs(self, gen: torch.Generator) -> dict[str, torch.Tensor]:
        return sampling_inputs(gen, self.b, self.s, self.v, self.sampling, self.draw, shift=True)


SAMPLING_NEXT_TOKEN_SPECS = (
    NextTokenSpec(4, 6, 32, Sampling(top_k=5, temperature=0.7)),
    NextTokenSpec(2, 8, 48, Sampling(top_k=5, top_p=0.9, temperature=1.5), 3, Draw(ties=True, masked=0.2)),
    NextTokenSpec(2, 8, 48, Sampling(top_p=1e-6, temperature=0.5)),  # argmax only
    NextTokenSpec(
        4, 6, 37, Sampling(temperature=2.0), draw=Draw(masked=0.2)
    ),  # temperature only: no all-to-all, uneven shards
    NextTokenSpec(4, 6, 37, Sampling(temperature=0.6), 4),
    NextTokenSpec(2, 4, 16, Sampling(top_k=3, top_p=0.7, temperature=0.8), 2, Draw(scale=300.0)),  # huge logits
)
QUICK_SAMPLING_NEXT_TOKEN = (SAMPLING_NEXT_TOKEN_SPECS[1], SAMPLING_NEXT_TOKEN_SPECS[3])


def sampling_next_token_case(spec: NextTokenSpec) -> Case:
    smp = spec.sampling

    def call(impl, ctx, logits, target, chunk, inference_only=False):
        return impl.from_parallel_logits_to_logprobs(
            logits,
            target,
            *vocab_range(ctx),
            ctx.group("tp"),
            inference_only=inference_only,
            cp_group=None,
            chunk_size=chunk,
            sampling_params=sampling_params(smp),
        )

    properties = None
    if smp.filtering:
        properties = survivors_sum_to_1(
            lambda impl, ctx, logits, t: call(impl, ctx, logits, t, spec.chunk, inference_only=True), spec.v
        )
    if spec.chunk is not None:
        properties = combine(
            properties,
            chunked_equals_unchunked(
                lambda impl, ctx, x: call(impl, ctx, x["logits"], x["target"], None, inference_only=True)
            ),
        )
    return Case(
        op=OP + "from_parallel_logits_to_logprobs",
        case_id=f"{spec.case_id}-chunk{spec.chunk}",
        params=spec.params,
        make_inputs=spec.inputs,
        reference=next_token_reference(smp),
        run=lambda impl, ctx, x: call(impl, ctx, x["logits"], x["target"], spec.chunk),
        grad_inputs=("logits",),
        properties=properties,
        supports=next_token_supports(spec.b, spec.s, spec.v, smp),
        comm=contract(lambda ctx: next_token_comm(ctx, spec.s, smp, spec.chunk)),
        **LOGPROB_IO,
    )


@dataclass(frozen=True)
class FrontEndSpec:
    """A front end over from_parallel_logits_to_logprobs, without CP: `variant` names how it is called."""

    op: str
    variant: str
    logits: NextTokenSpec

    @property
    def case_id(self) -> str:
        chunk = self.logits.chunk
        return f"{self.variant}-{self.logits.case_id}" + (f"-chunk{chunk}" if chunk else "")

    @property
    def params(self) -> dict:
        return {"variant": self.variant, **self.logits.params}

    @property
    def replicated(self) -> bool:
        """Whether every rank holds the full vocab (no TP communication)."""
        return self.variant in ("vocab_replicated", "plain")


FRONT_END_SPECS = (
    FrontEndSpec(
        "get_logprobs_from_vocab_parallel_logits",
        "dtensor_ids",
        NextTokenSpec(4, 6, 37, NO_SAMPLING, draw=Draw(masked=0.2)),
    ),
    FrontEndSpec(
        "get_logprobs_from_vocab_parallel_logits",
        "tp_sharded",
        NextTokenSpec(2, 8, 48, Sampling(top_k=5, top_p=0.9, temperature=0.7), 3),
    ),
    FrontEndSpec(
        "get_logprobs_from_vocab_parallel_logits",
        "vocab_replicated",
        NextTokenSpec(4, 6, 32, Sampling(top_k=4, temperature=1.3)),
    ),
    FrontEndSpec(
        "get_next_token_logprobs_from_logits",
        "vocab_parallel_group",
        NextTokenSpec(4, 6, 32, NO_SAMPLING, draw=Draw(masked=0.2)),
    ),
    FrontEndSpec(
        "get_next_token_logprobs_from_logits",
        "vocab_parallel_group",
        NextTokenSpec(2, 8, 48, Sampling(top_k=5, top_p=0.9, temperature=0.7), draw=Draw(ties=True)),
    ),
    FrontEndSpec("get_next_token_logprobs_from_logits", "dtensor", NextTokenSpec(4, 6, 37, Sampling(temperature=1.5))),
    FrontEndSpec(
        "get_next_token_logprobs_from_logits",
        "plain",
        NextTokenSpec(4, 6, 32, Sampling(top_k=5, top_p=0.8, temperature=1.5)),
    ),
    FrontEndSpec(
        "dtensor_from_parallel_logits_to_logprobs",
        "plain_target",
        NextTokenSpec(4, 6, 37, NO_SAMPLING, draw=Draw(masked=0.2)),
    ),
    FrontEndSpec(
        "dtensor_from_parallel_logits_to_logprobs",
        "dtensor_target",
        NextTokenSpec(2, 8, 48, Sampling(top_k=5, temperature=0.7), 3),
    ),
    # DTensor ids, a type the seed documents, on ids in [0, V) (a seed-rule case): a module that fails on the DTensor
    # fails here too, so its line is never read as "raises on input only our rule feeds" (the masked case above)
    FrontEndSpec("get_logprobs_from_vocab_parallel_logits", "dtensor_ids", NextTokenSpec(2, 6, 32, NO_SAMPLING)),
)
QUICK_FRONT_END = (FRONT_END_SPECS[1], FRONT_END_SPECS[4], FRONT_END_SPECS[6], FRONT_END_SPECS[8])


def front_end_case(spec: FrontEndSpec) -> Case:
    """get_logprobs_from_vocab_parallel_logits (DTensor logits), get_next_token_logprobs_from_logits (its three
    dispatch cases) and dtensor_from_parallel_logits_to_logprobs."""
    lg, smp = spec.logits, spec.logits.sampling
    logits_layout = BATCH if spec.replicated else LOGITS

    def run(impl, ctx, x):
        sp, logits, ids = sampling_params(smp), x["logits"], x["target"]
        if spec.op == "get_logprobs_from_vocab_parallel_logits":
            if spec.variant == "dtensor_ids":
                ids = dtensor(ctx, ids, "target", BATCH, ("cp",))
            return impl.get_logprobs_from_vocab_parallel_logits(
                dtensor(ctx, logits, "logits", logits_layout),
                ids,
                seq_index=None,
                chunk_size=lg.chunk,
                sampling_params=sp,
            )
        if spec.op == "get_next_token_logprobs_from_logits":
            kw = {}
            if spec.variant == "vocab_parallel_group":
                kw = dict(vocab_parallel_rank=ctx.rank("tp"), vocab_parallel_group=ctx.group("tp"))
            elif spec.variant == "dtensor":
                logits = dtensor(ctx, logits, "logits", logits_layout)
            return impl.get_next_token_logprobs_from_logits(
                ids, logits, seq_index=None, context_parallel_group=None, sampling_params=sp, **kw
            )
        if spec.variant == "dtensor_target":
            ids = dtensor(ctx, ids, "target", BATCH, ("cp",))
        return impl.dtensor_from_parallel_logits_to_logprobs(
            logits,
            ids,
            *vocab_range(ctx),
            ctx.group("tp"),
            inference_only=False,
            seq_index=None,
            chunk_size=lg.chunk,
            sampling_params=sp,
        )

    even = spec.variant == "vocab_parallel_group"
    return Case(
        op=OP + spec.op,
        case_id=spec.case_id,
        params=spec.params,
        make_inputs=lg.inputs,
        reference=next_token_reference(smp),
        run=run,
        input_layouts={"logits": logits_layout, "target": BATCH},
        output_layouts=(BATCH,),
        grad_inputs=("logits",),
        comm=NO_COMM if spec.replicated else contract(lambda ctx: next_token_comm(ctx, lg.s, smp, lg.chunk)),
        supports=batch_divides(lg.b) if spec.replicated else next_token_supports(lg.b, lg.s, lg.v, smp, even=even),
    )


# ---- scale: TP 8 and 16, DP 16 ---------------------------------------------------------------------

SCALE_SHAPE = Shape(2, 3, 6, Draw(masked=0.2))  # V = 6 < TP 8: TP ranks 6 and 7 (6 to 15 at TP 16) hold no vocab


def at_scale(case: Case, min_tp: int = 1) -> Case:
    """`case` planned only at world size 8 and up (and TP `min_tp` and up): the default 1/2/4 run does not grow."""
    supports = case.supports
    return replace(case, supports=lambda t: t.size >= 8 and t.tp >= min_tp and supports(t))


def scale_cases() -> list[Case]:
    """Vocab shards that are empty on most TP ranks (V < TP), and all-to-alls whose 32 rows split over DP 16."""
    vocab = [softmax_case(op, SCALE_SHAPE) for op in SOFTMAX_REFERENCES] + [
        logprob_case(SCALE_SHAPE),
        logprob_case(SCALE_SHAPE, 2),
        cross_entropy_case(SCALE_SHAPE),
    ]
    return [at_scale(c, min_tp=8) for c in vocab] + [at_scale(all_to_all_case(op, 32, 16)) for op in ALL_TO_ALL_LAYOUTS]


# ---- the case matrix -----------------------------------------------------------------------------


def cases(quick: bool = False) -> list[Case]:
    # The vocab-parallel ops support a TP rank holding no vocab entries (V < TP, V = 33 at TP 8): the cases test them.
    # bad input the seed does not describe (mismatched shapes, a vocab or row count TP does not divide)
    return cited(_matrix(quick) + scale_cases(), bad_input=ours(f"{DOC}#conventions-of-this-family"))


def _matrix(quick: bool) -> list[Case]:
    shapes = QUICK_SHAPES if quick else SHAPES
    return (
        [softmax_case(op, s) for s in shapes for op in SOFTMAX_REFERENCES]
        + logprob_cases(shapes, quick)
        + [cross_entropy_case(s) for s in shapes]
        + [cross_entropy_case(CROSS_ENTROPY_HUGE_NEG_INF)]
        + [cross_entropy_shape_mismatch_case()]
        + all_to_all_cases(quick)
        + sampling_cases(quick)
        + [gather_logprob_case(s) for s in (QUICK_GATHER_LOGPROB if quick else GATHER_LOGPROB_SPECS)]
        + [gather_logits_case(s) for s in (QUICK_GATHER_LOGITS if quick else GATHER_LOGITS_SPECS)]
        + [topk_case(s) for s in (QUICK_TOPK if quick else TOPK_SPECS)]
        + [distillation_case(s) for s in (QUICK_DISTILL if quick else DISTILL_SPECS)]
        + [entropy_case(s) for s in (QUICK_ENTROPY if quick else ENTROPY_SPECS)]
        + hidden_states_cases(quick)
        + [sampling_next_token_case(s) for s in (QUICK_SAMPLING_NEXT_TOKEN if quick else SAMPLING_NEXT_TOKEN_SPECS)]
        + [front_end_case(s) for s in (QUICK_FRONT_END if quick else FRONT_END_SPECS)]
    )


# ---- fuzz spaces (`shardcheck fuzz`) --------------------------------------------------------------
# Each op's cases above generalised: the topology first (B over DP; where the layout needs it, B·S rows and V over
# TP), then sizes down to 1 (V below TP leaves ranks empty vocab shards), chunk sizes that do or do not divide S,
# masking ratios up to every target, huge logits, ties, -inf, k up to V, every dtype.  The same factories build
# the case as for the fixed matrix.  Next-token ops draw S >= 2: their unshifted target [B, L] needs L >= 2 (our
# implementation raises below that, a one-token target has no next token to score).


def _draw_of(p: dict) -> Draw:
    return Draw(scale=p["scale"], ties=p["ties"], neg_inf=p["neg_inf"], masked=p.get("masked", 0.0))


def _space(op: str, build, sizes, legal=lambda t: True, by_dtype: bool = False):
    """A FuzzSpace of `op`: the topology (legal ones, smallest first), a dtype, then `sizes(d, topo)` (`by_dtype`:
    `sizes(d, topo, dtype)`) draws the op's own parameters with hypothesis's draw function `d`; `build(params)` is
    the case."""

    def params(topologies):
        from shardcheck.suites._fuzz_draws import DTYPES, st, topology

        @st().composite
        def draw(d):
            topo, dtype = d(topology(topologies, legal)), d(st().sampled_from(DTYPES))
            own = sizes(d, Topology(*topo), dtype) if by_dtype else sizes(d, Topology(*topo))
            return {"topology": topo, "dtype": dtype, **own}

        return draw()

    return FuzzSpace(OP + op, params, build)


def _logits_sizes(masked: bool = False, chunk: str = "none", b_most: int = 2, v_most: int = 40, s_least: int = 1):
    """B (a multiple of DP), S (s_least..9), V, the Draw fields, and `chunk`: "none", "int" (1..9) or "optional"."""

    def sizes(d, t):
        from shardcheck.suites._fuzz_draws import chunk_or_none, logits_draw, multiple_of, st
        from shardcheck.suites._fuzz_draws import masked as masked_ratio

        p = {
            "B": d(multiple_of(t.dp, b_most)),
            "S": d(st().integers(s_least, 9)),
            "V": d(st().integers(1, v_most)),
            **d(logits_draw()),
        }
        if masked:
            p["masked"] = d(masked_ratio())
        if chunk != "none":
            p["chunk_size"] = d(st().integers(1, 9) if chunk == "int" else chunk_or_none())
        return p

    return sizes


def _shape(p: dict, masked: bool = True) -> Shape:
    return Shape(p["B"], p["S"], p["V"], replace(_draw_of(p), masked=p.get("masked", 0.0) if masked else 0.0))


def _sampling_sizes(next_token: bool = False):
    """B·S rows over TP and V over TP (the sampling all-to-all), top-k up to V, top-p, temperature."""

    def sizes(d, t):
        from shardcheck.suites._fuzz_draws import chunk_or_none, masked, multiple_of, st

        s = st()
        v = t.tp * d(s.integers(-(-3 // t.tp), max(2, 32 // t.tp)))  # V >= 3: a third of the targets is a top-3 id
        s_least = 2 if next_token else 1
        p = {
            "B": d(multiple_of(t.dp, 2)),
            "S": d(multiple_of(t.tp, max(1, 8 // t.tp), s_least)),
            "V": v,
            "scale": d(s.sampled_from([3.0, 300.0])),
            "ties": d(s.booleans()),
            "neg_inf": 0.0,
            "masked": d(masked()),
            "top_k": d(s.one_of(s.none(), s.integers(0, v + 2))),
            "top_p": d(s.sampled_from([1.0, 0.9, 0.5, 1e-6])),
            "chunk_size": d(chunk_or_none()),
        }
        if next_token:
            p["temperature"] = d(s.sampled_from([1.0, 0.5, 2.0]))
        return p

    return sizes


def _sampling(p: dict) -> Sampling:
    return Sampling(top_k=p["top_k"], top_p=p["top_p"], temperature=p.get("temperature", 1.0))


def _hidden_sizes(via: bool):
    def sizes(d, t, dtype):
        from shardcheck.suites._fuzz_draws import chunk_or_none, masked, multiple_of, st

        s = st()
        # Huge hidden states (scale 10: logits in the hundreds) in float64 only.  The op projects in the input dtype,
        # so its logits legitimately round otherwise than the reference's (an ulp of 270 is 1.5e-5 in float32); the
        # gradient of an almost one-hot row is ~exp(-gap) and carries that error relative to itself, which the
        # per-row budget, set by the row's tiny values and the reference's own (at times luckily exact) rounding,
        # cannot judge (fuzz: tp4 float32 V=2, 4.5e-5 relative against the reference's 3e-7).
        huge_ok = dtype == "float64"
        s_least = 2 if via else 1  # via: the next-token op (unshifted target)
        p = {
            "S": d(multiple_of(t.tp, max(1, 8 // t.tp), s_least)),
            "B": d(multiple_of(t.dp, 2)),
            "H": d(s.integers(1, 8)),
            "V": d(s.integers(1, 40)),
            "chunk_size": d(chunk_or_none() if via else s.integers(1, 9)),
            "scale": d(s.sampled_from([1.0, 10.0] if huge_ok else [1.0])),
            "masked": d(masked()),
        }
        if via:
            p["weight_via"] = d(s.sampled_from(["output_weight", "layer_module", "layer_tensor"]))
        return p

    return sizes


def _hidden_case(p: dict) -> Case:
    return hidden_states_case(
        HiddenSpec(p["S"], p["B"], p["H"], p["V"], p["chunk_size"], p.get("weight_via"), p["scale"], p["masked"])
    )


def _gather_sizes(chunk: str, tp_group: bool = False):
    def sizes(d, t):
        from shardcheck.suites._fuzz_draws import st

        p = _logits_sizes(masked=True, chunk=chunk)(d, t)
        p["K"] = d(st().integers(1, 8))
        if tp_group:
            p["tp_group"] = d(st().sampled_from(["tp", "none"]))
        return p

    return sizes


def _gather_spec(p: dict) -> GatherSpec:
    return GatherSpec(p["B"], p["S"], p["V"], p["K"], _draw_of(p), p.get("chunk_size"), p.get("tp_group", "tp"))


def _topk_sizes(d, t):
    from shardcheck.suites._fuzz_draws import st

    p = _logits_sizes(chunk="optional")(d, t)
    p["k"] = d(st().integers(1, p["V"]))  # k > V: our implementation raises (docs/ops)
    return p


def _distill_sizes(d, t):
    from shardcheck.suites._fuzz_draws import multiple_of, st

    s = st()
    path = d(s.sampled_from(["group", "dtensor", "plain"]))
    v = d(multiple_of(t.tp, max(1, 40 // t.tp))) if path == "group" else d(s.integers(1, 40))
    return {
        "B": d(multiple_of(t.dp, 2)),
        "S": d(s.integers(2, 9)),
        "V": v,
        "K": d(s.integers(1, min(v, 8))),
        "zero_outside_topk": d(s.booleans()),
        "calculate_entropy": d(s.booleans()),
        "path": path,
        "scale": d(s.sampled_from([3.0, 300.0])),
        "ties": d(s.booleans()),
        "neg_inf": d(s.sampled_from([0.0, 0.3])),
    }


def _distill_case(p: dict) -> Case:
    return distillation_case(
        DistillSpec(
            p["B"], p["S"], p["V"], p["K"], p["zero_outside_topk"], p["calculate_entropy"], p["path"], _draw_of(p)
        )
    )


def _front_end_sizes(op: str):
    variants = {
        "get_logprobs_from_vocab_parallel_logits": ("dtensor_ids", "tp_sharded", "vocab_replicated"),
        "get_next_token_logprobs_from_logits": ("vocab_parallel_group", "dtensor", "plain"),
        "dtensor_from_parallel_logits_to_logprobs": ("plain_target", "dtensor_target"),
    }[op]

    def sizes(d, t):
        from shardcheck.suites._fuzz_draws import st

        p = _sampling_sizes(next_token=True)(d, t)
        p["variant"] = d(st().sampled_from(variants))
        return p

    return sizes


def _next_token_spec(p: dict) -> NextTokenSpec:
    draw = Draw(scale=p["scale"], ties=p["ties"], masked=p["masked"])
    return NextTokenSpec(p["B"], p["S"], p["V"], _sampling(p), p["chunk_size"], draw)


def fuzz_spaces() -> list[FuzzSpace]:
    spaces = [
        _space(op, lambda p, op=op: softmax_case(op, _shape(p, masked=False)), _logits_sizes())
        for op in SOFTMAX_REFERENCES
    ]
    spaces += [
        _space("DistributedLogprob", lambda p: logprob_case(_shape(p)), _logits_sizes(masked=True)),
        _space(
            "ChunkedDistributedLogprob",
            lambda p: logprob_case(_shape(p), p["chunk_size"]),
            _logits_sizes(masked=True, chunk="int"),
        ),
        _space(
            "from_parallel_logits_to_logprobs",
            lambda p: next_token_case(_shape(p), p["chunk_size"]),
            _logits_sizes(masked=True, chunk="optional", s_least=2),
        ),
        _space("DistributedCrossEntropy", lambda p: cross_entropy_case(_shape(p, masked=False)), _logits_sizes()),
    ]
    for op in ALL_TO_ALL_LAYOUTS:
        spaces.append(
            _space(
                op,
                lambda p, op=op: all_to_all_case(op, p["BS"], p["V"]),
                lambda d, t: {"BS": d(_multiple(t.dp * t.tp, 4)), "V": d(_multiple(t.tp, 6))},
            )
        )
    spaces += [
        _space(
            "DistributedLogprobWithSampling",
            lambda p: sampling_case(SamplingSpec(p["B"], p["S"], p["V"], _sampling(p), _no_inf_draw(p))),
            _sampling_sizes(),
        ),
        _space(
            "ChunkedDistributedLogprobWithSampling",
            lambda p: sampling_case(
                SamplingSpec(p["B"], p["S"], p["V"], _sampling(p), _no_inf_draw(p)), p["chunk_size"] or 1
            ),
            _sampling_sizes(),
        ),
        _space("ChunkedDistributedGatherLogprob", lambda p: gather_logprob_case(_gather_spec(p)), _gather_sizes("int")),
        _space(
            "gather_logits_at_global_indices",
            lambda p: gather_logits_case(_gather_spec(p)),
            _gather_sizes("optional", tp_group=True),
        ),
        _space(
            "distributed_vocab_topk",
            lambda p: topk_case(TopkSpec(p["B"], p["S"], p["V"], p["k"], _draw_of(p), p["chunk_size"])),
            _topk_sizes,
        ),
        _space("get_distillation_topk_logprobs_from_logits", _distill_case, _distill_sizes),
        _space(
            "ChunkedDistributedEntropy",
            lambda p: entropy_case(EntropySpec(p["B"], p["S"], p["V"], p["chunk_size"], _draw_of(p))),
            _logits_sizes(chunk="int"),
        ),
        _space("ChunkedDistributedHiddenStatesToLogprobs", _hidden_case, _hidden_sizes(via=False), by_dtype=True),
        _space("from_parallel_hidden_states_to_logprobs", _hidden_case, _hidden_sizes(via=True), by_dtype=True),
    ]
    for op in (
        "get_logprobs_from_vocab_parallel_logits",
        "get_next_token_logprobs_from_logits",
        "dtensor_from_parallel_logits_to_logprobs",
    ):
        spaces.append(
            _space(
                op,
                lambda p, op=op: front_end_case(FrontEndSpec(op, p["variant"], _next_token_spec(p))),
                _front_end_sizes(op),
            )
        )
    return spaces


def _multiple(n: int, most: int):
    from shardcheck.suites._fuzz_draws import multiple_of

    return multiple_of(n, most)


def _no_inf_draw(p: dict) -> Draw:
    return Draw(scale=p["scale"], ties=p["ties"], masked=p["masked"])
