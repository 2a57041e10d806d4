"""Suite for nemo_automodel.components.loss.kd_loss: forward-KL distillation loss, plain and TP.

Layouts: logits [B, S, V] are sharded on the batch over DP and on the vocab over TP
(torch.chunk sizes, so V=37 gives uneven shards), or replicated over TP for the plain
(non-TP) path; labels [B, S] are sharded over DP and replicated over TP. The scalar loss is
`Partial` over DP: with `num_batch_labels` = the global count of valid tokens, the sum of
the DP ranks' losses is the single-device loss on the full batch (checked by the harness,
values and gradients, and once more by the explicit `property:dp_sum`). Cases without
`num_batch_labels` (a per-rank mean) run at dp == 1 only.

TP modes: `dtensor` (logits wrapped as DTensors sharded on the last dim, so the group is
inferred), `group` (local vocab shards + explicit tp_group), `plain` (full-vocab tensors).
Every KDLoss case declares its exact per-rank collectives (`kd_comm`, checked as `property:comm`);
`bench_cases()` at the end are the benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from shardcheck import BadInput, Case, FuzzSpace, Layout, Partial, Property, Replicate, Shard, cite, seed
from shardcheck.harness.core.compare import budget
from shardcheck.reference import kd_loss as ref

FAMILY = "kd_loss"
OP = FAMILY + "."

VOCAB_SHARDED = Layout(dp=Shard(0), tp=Shard(-1))  # [B, S, V]: batch over DP, vocab over TP
BATCH = Layout(dp=Shard(0))  # [B, S] labels, or full-vocab logits: batch over DP, replicated over TP
LOSS = Layout(dp=Partial())  # scalar: the full loss is the sum of the DP ranks' losses


# ---- inputs -------------------------------------------------------------------------------


def make_logits(gen: torch.Generator, shape, scale: float = 3.0, neg_inf: float = 0.0) -> torch.Tensor:
    logits = torch.randn(shape, generator=gen, dtype=torch.float64) * scale
    if neg_inf:
        mask = torch.rand(shape, generator=gen, dtype=torch.float64) < neg_inf
        mask[..., 0] = False  # every row keeps some teacher mass
        logits = logits.masked_fill(mask, float("-inf"))
    return logits


def make_labels(
    gen: torch.Generator, b: int, s: int, v: int, valid: list[int], ignore_index: int, m100: float = 0.0
) -> torch.Tensor:
    """Token ids with exactly `valid[row]` valid positions per row (random places), the rest
    `ignore_index`; `m100` of the valid ones become -100 (valid when ignore_index != -100)."""
    labels = torch.randint(0, v, (b, s), generator=gen)
    labels = torch.where(labels == ignore_index, (labels + 1) % v, labels)
    for row, n in enumerate(valid):
        keep = torch.randperm(s, generator=gen)[:n]
        mask = torch.ones(s, dtype=torch.bool)
        mask[keep] = False
        labels[row][mask] = ignore_index
    if m100:
        flip = (torch.rand((b, s), generator=gen) < m100) & (labels != ignore_index)
        labels = torch.where(flip, -100, labels)
    return labels


@dataclass(frozen=True)
class Spec:
    mode: str  # "dtensor" | "group" | "plain"
    b: int = 4
    s: int = 6
    v: int = 37
    valid: tuple[int, ...] | None = None  # valid tokens per row (None: all valid)
    temperature: float = 1.0
    fp32_upcast: bool = True
    ignore_index: int = -100
    m100: float = 0.0  # fraction of valid labels set to -100 (only meaningful with a custom ignore_index)
    nbl: str = "tensor"  # num_batch_labels: "tensor" | "int" | "none" (per-rank mean)
    nbl_extra: int = 0  # valid tokens of other micro-batches added to the global count
    chunk: int = 0
    scale: float = 3.0
    neg_inf: float = 0.0  # teacher logits masked to -inf
    tag: str = ""

    @property
    def case_id(self) -> str:
        parts = [self.mode, f"b{self.b}s{self.s}v{self.v}", f"T{self.temperature:g}"]
        if not self.fp32_upcast:
            parts.append("noupcast")
        if self.ignore_index != -100:
            parts.append(f"ign{self.ignore_index}")
        parts.append("mean" if self.nbl == "none" else f"nbl{self.nbl}")
        parts.append(f"chunk{self.chunk}")
        if self.valid is not None and any(self.valid) and min(self.valid) < self.s:
            parts.append("masked")
        if self.scale != 3.0:
            parts.append(f"scale{self.scale:g}")
        if self.neg_inf:
            parts.append("teacher-inf")
        if self.tag:
            parts.append(self.tag)
        return "-".join(parts)

    @property
    def params(self) -> dict:
        return {
            "mode": self.mode,
            "B": self.b,
            "S": self.s,
            "V": self.v,
            "valid_per_row": list(self.valid) if self.valid is not None else None,
            "temperature": self.temperature,
            "fp32_upcast": self.fp32_upcast,
            "ignore_index": self.ignore_index,
            "num_batch_labels": self.nbl,
            "chunk_size": self.chunk,
            "scale": self.scale,
            "teacher_neg_inf": self.neg_inf,
        }


def _inputs(spec: Spec):
    def make(gen: torch.Generator) -> dict[str, torch.Tensor]:
        b, s, v = spec.b, spec.s, spec.v
        valid = list(spec.valid) if spec.valid is not None else [s] * b
        x = {
            "student_logits": make_logits(gen, (b, s, v), spec.scale),
            "teacher_logits": make_logits(gen, (b, s, v), spec.scale, spec.neg_inf),
            "labels": make_labels(gen, b, s, v, valid, spec.ignore_index, spec.m100),
        }
        if spec.nbl != "none":  # the GLOBAL count of valid tokens, replicated on every rank
            x["num_batch_labels"] = (x["labels"] != spec.ignore_index).sum() + spec.nbl_extra
        return x

    return make


def _reference(spec: Spec):
    def reference(x):
        return ref.kd_loss(
            x["student_logits"],
            x["teacher_logits"],
            x["labels"],
            ignore_index=spec.ignore_index,
            temperature=spec.temperature,
            fp32_upcast=spec.fp32_upcast,
            num_batch_labels=x.get("num_batch_labels"),
        )

    return reference


def _dtensor(ctx, local: torch.Tensor, full_shape) -> DTensor:
    """A vocab-sharded DTensor over the case's mesh (uneven shards: global shape given)."""
    ndim = local.ndim
    stride = torch.empty(full_shape, device="meta").stride()
    return DTensor.from_local(
        local,
        ctx.mesh,
        [Shard(0), Replicate(), Shard(ndim - 1)],
        run_check=False,
        shape=torch.Size(full_shape),
        stride=stride,
    )


# KDLoss's documented defaults (the seed's signature): a caller leaves them out.
SEED_DEFAULTS = {"ignore_index": -100, "temperature": 1.0, "fp32_upcast": True, "tp_group": None, "chunk_size": 0}


def _constructor_kwargs(spec: Spec, tp_group) -> dict:
    """KDLoss's arguments as its callers pass them: those the case sets away from the seed's defaults.  A version
    without a later parameter (chunk_size, tp_group) is then judged on the values of every case that does not use
    it, and the cases that do raise on the signature's line (a missing T² in a version older than chunk_size was
    hidden behind the TypeError of passing chunk_size=0)."""
    given = {
        "ignore_index": spec.ignore_index,
        "temperature": spec.temperature,
        "fp32_upcast": spec.fp32_upcast,
        "tp_group": tp_group,
        "chunk_size": spec.chunk,
    }
    return {name: value for name, value in given.items() if value != SEED_DEFAULTS[name]}


def _run(spec: Spec):
    def run(impl, ctx, x):
        student, teacher = x["student_logits"], x["teacher_logits"]
        tp_group = None
        if spec.mode == "dtensor":
            student = _dtensor(ctx, student, ctx.full_shapes["student_logits"])
            teacher = _dtensor(ctx, teacher, ctx.full_shapes["teacher_logits"])
        elif spec.mode == "group":
            tp_group = ctx.group("tp")
        loss_fn = impl.KDLoss(**_constructor_kwargs(spec, tp_group))
        nbl = x.get("num_batch_labels")
        if spec.nbl == "int":
            nbl = int(nbl)
        return loss_fn(student, teacher, x["labels"], num_batch_labels=nbl)

    return run


def _budget(golden: torch.Tensor, naive: torch.Tensor, dtype: torch.dtype) -> float:
    """The harness's budget for one tensor (κ·err_naive + floor; float64: relative 1e-10)."""
    return budget(golden, naive, dtype)[0]


def _loss_budget(
    spec: Spec, full: dict[str, torch.Tensor], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(golden, naive, budget) of the scalar loss on the full (dtype-rounded) inputs.

    The harness budget κ·err_naive + floor, widened for fp32_upcast=False in a 16-bit
    dtype: the whole loss is then computed in that dtype, and any composition of ops
    (chunks, TP partial sums) rounds log P, log Q and P at least once each, i.e. up to
    eps·T²·Σ_v P_v(|log P_v| + |log Q_v| + |log P_v − log Q_v|) per token. A scalar's
    err_naive is a single rounding sample (sometimes ~0 by luck) and does not cover that.
    """
    reference = _reference(spec)
    golden = reference({k: v.double() if v.is_floating_point() else v for k, v in full.items()})
    naive = reference(full)
    b = _budget(golden, naive, naive.dtype)
    if not spec.fp32_upcast and dtype in (torch.bfloat16, torch.float16):
        v = full["student_logits"].shape[-1]
        valid = (full["labels"] != spec.ignore_index).reshape(-1)
        t = full["teacher_logits"].double().reshape(-1, v)[valid] / spec.temperature
        q = full["student_logits"].double().reshape(-1, v)[valid] / spec.temperature
        log_p, log_q = t.log_softmax(-1), q.log_softmax(-1)
        p = log_p.exp()
        terms = torch.where(p > 0, p * (log_p.abs() + log_q.abs() + (log_p - log_q).abs()), torch.zeros_like(p))
        denom = full.get("num_batch_labels", max(int(valid.sum()), 1))
        composed = torch.finfo(dtype).eps * spec.temperature**2 * float(terms.sum()) / float(denom)
        b = max(b, composed)
    return golden, naive, b


def _loss_check(spec: Spec):
    """Forward check of the loss for fp32_upcast=False: dtype of the reference, error within _loss_budget."""

    def check(got, expected, full, local, ctx):
        golden, naive, b = _loss_budget(spec, full, ctx.dtype)
        if not isinstance(got, torch.Tensor) or got.shape != golden.shape:
            return False, f"got {type(got).__name__} {tuple(getattr(got, 'shape', ()))}, expected a scalar tensor"
        if got.dtype != naive.dtype:
            return False, f"dtype {str(got.dtype)[6:]}, expected {str(naive.dtype)[6:]} (fp32_upcast=False)"
        total = LOSS.reduce_partial(got, ctx.mesh).double().cpu()
        err = float((total - golden).abs()) if torch.isfinite(total) else float("inf")
        return err <= b, f"|err| {err:.3g}, budget {b:.3g}: got {float(total):.10g}, expected {float(golden):.10g}"

    return check


def _dp_sum_property(spec: Spec):
    """all_reduce over DP of the per-rank losses == the reference loss on the full batch."""

    def properties(ctx, full, local, outs):
        if ctx.size("dp") == 1:
            return []
        got = outs[0].detach().to(torch.float64).clone()
        dist.all_reduce(got, group=ctx.group("dp"))
        golden, _, b = _loss_budget(spec, full, ctx.dtype)
        err = float((got.cpu() - golden).abs())
        ok = err <= b  # False for NaN
        return [
            Property(
                "dp_sum",
                ok,
                err,
                f"sum over {ctx.size('dp')} DP ranks {float(got):.10g}, "
                f"full-batch reference {float(golden):.10g}, |err| {err:.3g}, budget {b:.3g}",
            )
        ]

    return properties


def _compute_dtype(spec: Spec, dtype: torch.dtype) -> torch.dtype:
    # KDLoss's softmax math: at least float32 with fp32_upcast, else the logits' dtype.
    return torch.promote_types(dtype, torch.float32) if spec.fp32_upcast else dtype


def _n_valid(spec: Spec, ctx) -> int:
    """Valid tokens on this rank: make_labels gives row r exactly valid[r] of them (an m100 label
    is valid when ignore_index != -100); labels are sharded over DP by rows, replicated over TP."""
    valid = list(spec.valid) if spec.valid is not None else [spec.s] * spec.b
    start, end = ctx.local_range("labels", 0)
    return sum(valid[start:end])


def kd_comm(spec: Spec):
    """Communication contract of KDLoss on one rank (property:comm): exactly what the
    correct implementation needs, so any extra collective, call or byte fails.

    TP paths ("group", "dtensor"), n = valid tokens of this DP rank, c = chunks = ceil(n / chunk)
    (one chunk when chunk_size is 0), e = bytes of the compute dtype:
      forward  all_reduce@tp: 2·c + 1 calls, 5·n·e bytes
               (per chunk one MAX of the [2, chunk] teacher/student row maxima and one SUM of
               the [2, chunk] normalisers; then one SUM of the [n] per-token partial KL);
      backward nothing: the per-token KL is replicated over TP and every rank gets the same
               upstream gradient, so each rank's vocab-shard gradient is local.
    Lower bound: a vocab-parallel KL needs per-token scalars only (the global log-sum-exp of
    teacher and student, and the full-vocab KL): O(n) bytes independent of V, never an [N, V]
    gather, and no backward communication. No valid token: no collective at all (every TP
    rank sees the same labels and skips together). At tp == 1 the same calls go to a
    1-rank group (free; the contract is the implementation's, per rank).
    The DTensor path adds nothing of DTensor's own: to_local() / from_local() of vocab-sharded
    logits and their backward are local (labels are plain tensors), measured at dp/tp 1, 2, 4.
    Plain (non-TP) path: no collectives at all.
    """

    def comm(ctx) -> dict:
        n = _n_valid(spec, ctx)
        if spec.mode == "plain" or n == 0:
            return {"forward": {}, "backward": {}}
        chunks = -(-n // spec.chunk) if spec.chunk > 0 else 1
        e = _compute_dtype(spec, ctx.dtype).itemsize
        return {"forward": {"all_reduce@tp": (2 * chunks + 1, 5 * n * e)}, "backward": {}}

    return comm


def kd_case(spec: Spec, teacher_grad: bool = False) -> Case:
    """The loss on one spec. `teacher_grad`: a float64-only twin that also checks d loss / d teacher.

    The teacher gradient T·P_v·(log P_v − log Q_v − KL) cancels when P is peaked, so its
    low-precision error is set by that cancellation, not by the op: the κ·err_naive budget
    does not cover it (and with huge logits not even the float64 golden is accurate to
    1e-10 of its max), so it is checked in float64 on well-conditioned inputs only.
    """
    logits = BATCH if spec.mode == "plain" else VOCAB_SHARDED
    if spec.nbl == "none":

        def supports(t) -> bool:
            return t.dp == 1  # per-rank mean: only the full batch on one rank is the reference

    else:

        def supports(t, b=spec.b) -> bool:
            return b % t.dp == 0

    extra = (
        dict(
            case_id=spec.case_id + "-tgrad",
            grad_inputs=("student_logits", "teacher_logits"),
            dtypes=("float64",),
            params={**spec.params, "teacher_grad": True},
        )
        if teacher_grad
        else dict(
            case_id=spec.case_id,
            grad_inputs=("student_logits",),
            params=spec.params,
            properties=_dp_sum_property(spec) if spec.nbl != "none" else None,
        )
    )
    return Case(
        op=OP + "KDLoss",
        make_inputs=_inputs(spec),
        reference=_reference(spec),
        run=_run(spec),
        input_layouts={"student_logits": logits, "teacher_logits": logits, "labels": BATCH},
        output_layouts=(LOSS,),
        output_names=("loss",),
        supports=supports,
        output_checks={} if spec.fp32_upcast else {"loss": _loss_check(spec)},
        comm=kd_comm(spec),
        allows_float32=FP32_UPCAST_RULE if spec.fp32_upcast else None,
        **extra,
    )


def _well_conditioned(spec: Spec) -> bool:
    return spec.scale < 100


# fp32_upcast=True: the seed casts the logits to float32, so a float64 item computed in float32 is what it documents
# (docs/ops/kd_loss.md keeps float64 as float64, which is ours: not a finding either way).
FP32_UPCAST_RULE = "seed: 'Cast logits to float32 before computing softmax / log-softmax' (fp32_upcast)"


# ---- the case matrix ----------------------------------------------------------------------

MODES = ("dtensor", "group", "plain")
MASKED = (4, 4, 4, 4)  # 2 of 6 positions ignored per row
UNEVEN = (3, 3, 4, 4)  # 6 valid on DP rank 0 of 2, 8 on rank 1: chunk 3 divides one, not the other


def full_specs() -> list[Spec]:
    specs = []
    for mode in MODES:
        specs += [
            Spec(mode, valid=MASKED),  # T = 1, chunk 0
            Spec(mode, valid=MASKED, temperature=2.0, chunk=4),  # T^2 scaling; chunk divides 4 per row
            Spec(mode, b=2, s=8, v=32, valid=(5, 5), temperature=0.5, fp32_upcast=False, nbl="none", chunk=3),
            Spec(mode, valid=UNEVEN, chunk=3, neg_inf=0.3),  # chunk divides on some DP ranks only
            Spec(mode, b=2, s=5, v=37, valid=(0, 0), nbl="none", tag="all-ignored"),
            Spec(mode, b=2, s=5, v=33, valid=(4, 3), temperature=2.0, scale=300.0),  # logits x100
        ]
    specs += [
        Spec("group", b=4, s=7, v=32, valid=(5, 6, 7, 4), ignore_index=0, m100=0.3, nbl="int", chunk=1),
        Spec("dtensor", b=2, s=8, v=37, valid=(6, 7), ignore_index=7, m100=0.3, nbl="none", chunk=64),
        Spec("group", valid=(0, 0, 0, 0), nbl_extra=5, tag="all-ignored"),  # 0 / (tokens of other micro-batches)
        Spec("dtensor", valid=(0, 0, 5, 6), chunk=2, tag="dp-rank-empty"),  # DP rank 0 of 2 has no valid token
        Spec("plain", b=2, s=3, v=37, temperature=3.0, fp32_upcast=False, nbl="none", neg_inf=0.5),
        Spec("dtensor", b=4, s=8, v=32, valid=(8, 2, 5, 1), temperature=0.7, chunk=5),
        Spec("group", b=2, s=4, v=37, valid=(4, 3), fp32_upcast=False, neg_inf=0.3, scale=300.0),
    ]
    return specs


def quick_specs() -> list[Spec]:
    return [
        Spec("dtensor", valid=MASKED, temperature=2.0),
        Spec("group", valid=UNEVEN, ignore_index=0, m100=0.3, chunk=3, neg_inf=0.3),
        Spec("plain", b=2, s=8, v=32, valid=(4, 4), temperature=0.5, fp32_upcast=False, nbl="none", chunk=4),
        Spec("group", b=2, s=5, v=37, valid=(0, 0), nbl="none", tag="all-ignored"),
        Spec("dtensor", valid=(0, 0, 5, 6), chunk=2, tag="dp-rank-empty"),
    ]


@dataclass(frozen=True)
class Mismatch:
    """Student logits, teacher logits and labels of shapes that do not match: no answer is documented, the op
    must raise."""

    name: str
    student: tuple[int, ...]
    teacher: tuple[int, ...]
    labels: tuple[int, ...]
    what: str

    def inputs(self, gen: torch.Generator) -> dict[str, torch.Tensor]:
        return {
            "student_logits": make_logits(gen, self.student),
            "teacher_logits": make_logits(gen, self.teacher),
            "labels": torch.randint(0, self.student[-1], self.labels, generator=gen),
        }


MISMATCHES = (
    Mismatch("student-teacher-mismatch", (2, 4, 16), (2, 3, 16), (2, 4), "student and teacher logits"),
    Mismatch("labels-mismatch", (2, 4, 16), (2, 4, 16), (2, 3), "logits and labels"),
)


def mismatch_case(spec: Mismatch, mode: str) -> Case:
    logits = BATCH if mode == "plain" else VOCAB_SHARDED
    return Case(
        op=OP + "KDLoss",
        case_id=f"{spec.name}-{mode}",
        params={
            "mode": mode,
            "student": list(spec.student),
            "teacher": list(spec.teacher),
            "labels": list(spec.labels),
        },
        make_inputs=spec.inputs,
        reference=lambda x: (),
        run=_run(Spec(mode, nbl="none")),
        input_layouts={"student_logits": logits, "teacher_logits": logits, "labels": BATCH},
        bad_input=BadInput(f"{spec.what} of mismatched shapes"),
        dtypes=("float64",),
        supports=lambda t: 2 % t.dp == 0,
    )


def bad_input_cases() -> list[Case]:
    return [mismatch_case(spec, mode) for spec in MISMATCHES for mode in ("group", "plain")]


# ---- _infer_tp_group_from_dtensor ---------------------------------------------------------


def _infer_run(impl, ctx, x):
    local = x["logits"]
    full = ctx.full_shapes["logits"]
    stride = torch.empty(full, device="meta").stride()

    def dt(placements):
        # Local shape is irrelevant to the inference; the global shape is given.
        return DTensor.from_local(local, ctx.mesh, placements, run_check=False, shape=torch.Size(full), stride=stride)

    infer = impl._infer_tp_group_from_dtensor
    return {
        "plain": (infer(local), None),
        "vocab-on-tp": (infer(dt([Shard(0), Replicate(), Shard(2)])), ctx.group("tp")),
        "vocab-on-tp-only": (infer(dt([Replicate(), Replicate(), Shard(2)])), ctx.group("tp")),
        "vocab-on-dp": (infer(dt([Shard(2), Replicate(), Replicate()])), ctx.group("dp")),
        "seq-on-tp": (infer(dt([Shard(0), Replicate(), Shard(1)])), None),
        "batch-on-tp": (infer(dt([Replicate(), Replicate(), Shard(0)])), None),
        "replicated": (infer(dt([Replicate(), Replicate(), Replicate()])), None),
    }


def _describe_group(g) -> str:
    if g is None:
        return "None"
    if not isinstance(g, dist.ProcessGroup):
        return f"{type(g).__name__} (not a ProcessGroup)"
    return f"group of ranks {dist.get_process_group_ranks(g)}"


def _infer_properties(ctx, full, local, outs):
    props = []
    for name, (got, want) in outs[0].items():
        if want is None:
            ok = got is None
        else:
            ok = isinstance(got, dist.ProcessGroup) and dist.get_process_group_ranks(
                got
            ) == dist.get_process_group_ranks(want)
        props.append(
            Property(f"infer_group:{name}", ok, None, f"got {_describe_group(got)}, expected {_describe_group(want)}")
        )
    return props


def infer_cases() -> list[Case]:
    return [
        Case(
            op=OP + "_infer_tp_group_from_dtensor",
            case_id="placements",
            params={"shape": [4, 3, 8]},
            make_inputs=lambda gen: {"logits": make_logits(gen, (4, 3, 8))},
            reference=lambda x: (),
            run=_infer_run,
            output_layouts=(),
            output_names=(),
            properties=_infer_properties,
            dtypes=("float64",),
        )
    ]


def cases(quick: bool = False) -> list[Case]:
    specs = quick_specs() if quick else full_specs()
    out = [kd_case(s) for s in specs]
    out += [kd_case(s, teacher_grad=True) for s in (specs[1:2] if quick else specs) if _well_conditioned(s)]
    out += bad_input_cases()[:1] if quick else bad_input_cases()
    # KDLoss supports a TP rank holding no vocab entries (V = 37 at TP 16): the cases test them.
    return cite(
        [replace(c, empty_pieces=("tp",)) for c in out + infer_cases()],
        RULES,
        bad_input=seed("KDLoss.forward: teacher_logits 'Same shape as student_logits.'"),
    )


# Where each property's rule comes from (docs/ops/kd_loss.md#rules-seed-or-ours lists them).
RULES = {
    "property:dp_sum": seed("KDLoss.forward: 'When provided the loss is sum(kl_per_token) / num_batch_labels'"),
    "property:infer_group:*": seed(
        "_infer_tp_group_from_dtensor: 'If logits is a DTensor sharded on the vocab (last) "
        "dimension, return its TP process group. ... Returns None for plain tensors or "
        "DTensors that are not vocab-sharded.'"
    ),
}


# ---- benchmarks ---------------------------------------------------------------------------
# `shardcheck run --bench`: realistic CPU sizes, all tokens valid (N = B·S), the "group" TP path
# (local vocab shards + explicit tp_group; tp = 1 is the single-device cost of the same code, next
# to the reference's). Every sweep but "tp" runs at dp = cp = tp = 1 only; the "tp" sweep runs the
# same case ids at tp 1, 2, 4 (V is the total vocab: V_local = V / tp). The dtype is the CLI's
# (float32 on CPU by default). Sizes are chosen to keep the whole suite's bench near 2 minutes on
# a 2-core machine (each case runs ~15 fwd+bwd steps, plus ~13 reference steps at size 1).


def _tp_only(topo) -> bool:
    return topo.dp == 1 and topo.cp == 1


def _single(topo) -> bool:
    return topo.size == 1


def bench_case(sweep: str, b: int, s: int, v: int, chunk: int = 0, temperature: float = 1.0) -> Case:
    """One benchmark case of KDLoss; `sweep` names the parameter its sweep plot varies."""
    spec = Spec("group", b=b, s=s, v=v, temperature=temperature, chunk=chunk)
    return Case(
        op=OP + "KDLoss",
        case_id=f"bench-{sweep}-b{b}s{s}v{v}-chunk{chunk}",
        params={**spec.params, "N": b * s, "sweep": sweep},
        make_inputs=_inputs(spec),
        reference=_reference(spec),
        run=_run(spec),
        input_layouts={"student_logits": VOCAB_SHARDED, "teacher_logits": VOCAB_SHARDED, "labels": BATCH},
        output_layouts=(LOSS,),
        output_names=("loss",),
        grad_inputs=("student_logits",),
        comm=kd_comm(spec),
        supports=_tp_only if sweep == "tp" else _single,
    )


def bench_cases(quick: bool = False) -> list[Case]:
    if quick:  # tiny: two points per sweep axis that the report plots, a few seconds in all
        return [bench_case("S", 1, s, 1024) for s in (64, 256)] + [bench_case("tp", 1, 256, 1024)]
    return (
        [bench_case("S", 1, s, 1024) for s in (512, 1024, 2048, 4096)]  # N up to 4096
        + [bench_case("V", 1, 256, v) for v in (4096, 8192, 16384, 32768)]  # V up to 32k
        + [bench_case("chunk_size", 1, 2048, 2048, chunk) for chunk in (128, 512, 2048)]  # 2048: one chunk
        + [bench_case("tp", 1, 1024, 4096)]
    )  # V_local 4096, 2048, 1024 at tp 1, 2, 4


# ---- fuzz space (`shardcheck fuzz`) -----------------------------------------------------------
# The matrix above generalised: any mode, sizes (V down to 1, which leaves TP ranks empty shards), valid tokens per
# row (none to all), chunk sizes (0: one chunk), temperatures, ignore_index 0 with -100 labels among the valid ones,
# the three forms of num_batch_labels, huge logits and teacher -inf, every dtype; the teacher gradient in float64 on
# well-conditioned inputs (as kd_case).


def _kd_params(topologies):
    from shardcheck.suites._fuzz_draws import DTYPES, multiple_of, st, topology

    s = st()

    @s.composite
    def draw(d):
        nbl = d(s.sampled_from(["tensor", "int", "none"]))
        topo = d(topology(topologies, (lambda t: t.dp == 1) if nbl == "none" else (lambda t: True)))
        b, sl = d(multiple_of(topo[0], 2)), d(s.integers(1, 8))
        dtype, fp32_upcast = d(s.sampled_from(DTYPES)), d(s.booleans())
        # Huge logits in bfloat16/float32 math (no upcast) only where the budget can judge them: the KL gradient of
        # near-one-hot distributions is a difference of probabilities near 1, whose rounding is set by their scale,
        # not by the gradient's; correct code lands beyond the per-row budget (fuzz found it: V=2 at tp 2, bfloat16,
        # scale 300, grad 0 against -0.0014).  float64 and upcast draws cover huge logits.
        huge_ok = dtype == "float64" or fp32_upcast
        scale = d(s.sampled_from([3.0, 300.0] if huge_ok else [3.0]))
        v = d(s.integers(1, 40))
        # ignore_index 0 needs a vocab with another id: at V = 1 every label would be ignored while valid_per_row counts
        # some as valid, and num_batch_labels 0 makes the loss 0 / 0 (fuzz found it: the reference NaN, ours 0)
        ignore_index = d(s.sampled_from([-100, 0] if v >= 2 else [-100]))
        valid = d(s.lists(s.integers(0, sl), min_size=b, max_size=b))
        # num_batch_labels counts every micro-batch's tokens: 0 only when none has any (0 / 0, no loss defined)
        extra = d(s.integers(0 if sum(valid) else 1, 3)) if nbl != "none" else 0
        return {
            "topology": topo,
            "dtype": dtype,
            "mode": d(s.sampled_from(MODES)),
            "B": b,
            "S": sl,
            "V": v,
            "valid_per_row": valid,
            "temperature": d(s.sampled_from([1.0, 0.5, 2.0, 3.0])),
            "fp32_upcast": fp32_upcast,
            "ignore_index": ignore_index,
            "m100": d(s.sampled_from([0.0, 0.3])) if ignore_index != -100 else 0.0,
            "num_batch_labels": nbl,
            "nbl_extra": extra,
            "chunk_size": d(s.integers(0, 6)),
            "scale": scale,
            "teacher_neg_inf": d(s.sampled_from([0.0, 0.3])),
            "teacher_grad": dtype == "float64" and scale < 100 and d(s.booleans()),
        }

    return draw()


def _kd_fuzz_case(p: dict) -> Case:
    spec = Spec(
        p["mode"],
        b=p["B"],
        s=p["S"],
        v=p["V"],
        valid=tuple(p["valid_per_row"]),
        temperature=p["temperature"],
        fp32_upcast=p["fp32_upcast"],
        ignore_index=p["ignore_index"],
        m100=p["m100"],
        nbl=p["num_batch_labels"],
        nbl_extra=p["nbl_extra"],
        chunk=p["chunk_size"],
        scale=p["scale"],
        neg_inf=p["teacher_neg_inf"],
    )
    return kd_case(spec, teacher_grad=p["teacher_grad"])


def _infer_params(topologies):
    from shardcheck.suites._fuzz_draws import st, topology

    s = st()
    return s.fixed_dictionaries(
        {
            "topology": topology(topologies),
            "dtype": s.just("float64"),
            "shape": s.lists(s.integers(1, 6), min_size=3, max_size=3),
        }
    )


def _infer_fuzz_case(p: dict) -> Case:
    shape = tuple(p["shape"])
    return Case(
        op=OP + "_infer_tp_group_from_dtensor",
        case_id="placements",
        params={"shape": list(shape)},
        make_inputs=lambda gen: {"logits": make_logits(gen, shape)},
        reference=lambda x: (),
        run=_infer_run,
        output_layouts=(),
        output_names=(),
        properties=_infer_properties,
        dtypes=("float64",),
    )


def fuzz_spaces() -> list[FuzzSpace]:
    return [
        FuzzSpace(OP + "KDLoss", _kd_params, _kd_fuzz_case),
        FuzzSpace(OP + "_infer_tp_group_from_dtensor", _infer_params, _infer_fuzz_case),
    ]
