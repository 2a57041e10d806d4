"""Suite for nemo_rl.distributed.model_utils: vocab-parallel (TP) log-probs and friends.

Layouts: logits [B, S, V] are sharded on the batch over DP and on the vocab over TP
(contiguous, torch.chunk sizes, so V not divisible by TP gives uneven shards); targets are
sharded over DP and replicated over TP; TP-all-reduced outputs are replicated over TP.
Sequence-parallel hidden states [S, B, H] are sharded on S over TP and on B over DP; the output
weight [V, H] on V over TP, replicated over DP: its gradient is summed over DP in the case (as DDP
does), so every topology checks it.  No context parallelism here (cp_group None everywhere).

Every case that communicates declares its exact per-rank collectives (`comm`, checked as
`property:comm`; see "communication contracts"); `bench_cases()` at the end are the benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace
from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor, Shard

from harness.case import REPLICATED, BadInput, Case, GradSum, IndexRule, Layout, Property
from reference import model_utils as ref

FAMILY = "model_utils"
OP = FAMILY + "."

LOGITS = Layout(dp=Shard(0), tp=Shard(-1))  # [B, S, V]: batch over DP, vocab over TP
BATCH = Layout(dp=Shard(0))  # [B, ...]: batch over DP, replicated over TP
ROWS_VOCAB = Layout(dp=Shard(0), tp=Shard(1))  # 2-D [B*S, V] vocab-parallel
ROWS = Layout(dp=Shard(0), tp=Shard(0))  # 2-D [B*S, V] sequence-parallel


# ---- inputs -------------------------------------------------------------------------------

def make_logits(gen: torch.Generator, shape, scale: float = 3.0, ties: bool = False, neg_inf: float = 0.0) -> torch.Tensor:
    """Seeded logits; `ties` rounds them to few distinct values, `neg_inf` masks that fraction to -inf."""
    logits = torch.randn(shape, generator=gen, dtype=torch.float64) * scale
    if ties:
        logits = torch.round(logits / scale * 2)
    if neg_inf:
        mask = torch.rand(shape, generator=gen, dtype=torch.float64) < neg_inf
        mask[..., 0] = False  # keep every row finite somewhere
        logits = logits.masked_fill(mask, float("-inf"))
    return logits


def make_targets(gen: torch.Generator, shape, vocab: int, masked: float = 0.0, avoid: torch.Tensor | None = None) -> torch.Tensor:
    """Token ids in [0, V); `masked` of them -100 and a few out of range (logprob 0, no gradient).
    `avoid` (logits) keeps targets off -inf logits (index 0 is always finite)."""
    target = torch.randint(0, vocab, shape, generator=gen)
    if avoid is not None:
        target = torch.where(torch.isinf(avoid.gather(-1, target.unsqueeze(-1)).squeeze(-1)), 0, target)
    if masked:
        r = torch.rand(shape, generator=gen)
        target = torch.where(r < masked, -100, target)
        target = torch.where((r >= masked) & (r < masked * 1.25), vocab + 3, target)
    return target


def _logits_and_target(gen, b, s, v, scale=3.0, ties=False, neg_inf=0.0, masked=0.0, shift=False):
    logits = make_logits(gen, (b, s, v), scale, ties, neg_inf)
    avoid = torch.cat([logits[:, 1:], logits[:, :1]], dim=1) if shift else logits  # shifted ops read target[t+1]
    return {"logits": logits, "target": make_targets(gen, (b, s), v, masked, avoid=avoid)}


def _batch_divides(b: int):
    return lambda topo: b % topo.dp == 0


# ---- cases --------------------------------------------------------------------------------

# (B, S, V, extra): V=37 and V=33 give uneven vocab shards at TP 2 and 4.
SHAPES = [
    (4, 8, 32, {}),
    (4, 6, 37, {"masked": 0.3}),
    (2, 5, 33, {"scale": 300.0, "masked": 0.2}),  # huge logits: stability (x100 of the usual scale)
    (4, 4, 24, {"ties": True, "masked": 0.2}),
    (4, 7, 40, {"neg_inf": 0.2, "masked": 0.2}),
]
QUICK_SHAPES = [SHAPES[1], SHAPES[2]]


def _case_id(b, s, v, extra) -> str:
    tags = "".join(f"-{k}{'' if v is True else v}" for k, v in extra.items())
    return f"b{b}s{s}v{v}{tags}"


def softmax_cases(shapes) -> list[Case]:
    cases = []
    for b, s, v, extra in shapes:
        extra = {k: x for k, x in extra.items() if k != "masked"}
        for name, reference in (("_compute_distributed_log_softmax", ref.log_softmax),
                                ("_compute_distributed_softmax", ref.softmax)):
            cases.append(Case(
                op=OP + name, case_id=_case_id(b, s, v, extra), params={"B": b, "S": s, "V": v, **extra},
                make_inputs=lambda gen, b=b, s=s, v=v, extra=extra: {"logits": make_logits(gen, (b, s, v), **extra)},
                reference=lambda x, reference=reference: reference(x["logits"]),
                run=lambda impl, ctx, x, name=name: getattr(impl, name)(x["logits"], ctx.group("tp")),
                input_layouts={"logits": LOGITS}, output_layouts=(LOGITS,), supports=_batch_divides(b),
                comm=_contract(lambda ctx: (softmax_comm(ctx), {}))))
    return cases


def _vocab_range(ctx):
    return ctx.local_range("logits", -1)


def logprob_cases(shapes, quick: bool) -> list[Case]:
    cases = []
    chunk_sizes = [3] if quick else [3, 1, 64]  # 3 does not divide S; 64 > S (a single chunk)
    for b, s, v, extra in shapes:
        params = {"B": b, "S": s, "V": v, **extra}
        inputs = partial(lambda gen, b, s, v, extra, shift=False: _logits_and_target(gen, b, s, v, shift=shift, **extra),
                         b=b, s=s, v=v, extra=extra)
        common = dict(input_layouts={"logits": LOGITS, "target": BATCH}, output_layouts=(BATCH,),
                      grad_inputs=("logits",), supports=_batch_divides(b))
        cases.append(Case(
            op=OP + "DistributedLogprob", case_id=_case_id(b, s, v, extra), params=params, make_inputs=inputs,
            reference=lambda x: ref.logprob(x["logits"], x["target"]),
            run=lambda impl, ctx, x: impl.DistributedLogprob.apply(x["logits"], x["target"], *_vocab_range(ctx), ctx.group("tp")),
            comm=_contract(lambda ctx, s=s: logprob_comm(ctx, s)), **common))
        for chunk in chunk_sizes:
            cases.append(Case(
                op=OP + "ChunkedDistributedLogprob", case_id=f"{_case_id(b, s, v, extra)}-chunk{chunk}",
                params={**params, "chunk_size": chunk}, make_inputs=inputs,
                reference=lambda x: ref.logprob(x["logits"], x["target"]),
                run=lambda impl, ctx, x, chunk=chunk: impl.ChunkedDistributedLogprob.apply(
                    x["logits"], x["target"], *_vocab_range(ctx), chunk, ctx.group("tp")),
                comm=_contract(lambda ctx, s=s, chunk=chunk: logprob_comm(ctx, s, chunk)), **common))
        for chunk in [None] + chunk_sizes[:1]:
            cases.append(Case(
                op=OP + "from_parallel_logits_to_logprobs", case_id=f"{_case_id(b, s, v, extra)}-chunk{chunk}",
                params={**params, "chunk_size": chunk}, make_inputs=partial(inputs, shift=True),
                reference=lambda x: ref.next_token_logprobs(x["logits"], x["target"]),
                run=lambda impl, ctx, x, chunk=chunk: impl.from_parallel_logits_to_logprobs(
                    x["logits"], x["target"], *_vocab_range(ctx), ctx.group("tp"), chunk_size=chunk),
                comm=_contract(lambda ctx, s=s, chunk=chunk: logprob_comm(ctx, s, chunk)), **common))
    # inference_only: same values, forward only.
    b, s, v, extra = shapes[0]
    inputs = partial(lambda gen, b, s, v, extra: _logits_and_target(gen, b, s, v, **extra), b=b, s=s, v=v, extra=extra)
    for op, call in (("DistributedLogprob", lambda impl, ctx, x: impl.DistributedLogprob.apply(
                         x["logits"], x["target"], *_vocab_range(ctx), ctx.group("tp"), True)),
                     ("ChunkedDistributedLogprob", lambda impl, ctx, x: impl.ChunkedDistributedLogprob.apply(
                         x["logits"], x["target"], *_vocab_range(ctx), 2, ctx.group("tp"), True))):
        cases.append(Case(op=OP + op, case_id=f"{_case_id(b, s, v, extra)}-inference_only", params={"B": b, "S": s, "V": v,
                          "inference_only": True, **extra}, make_inputs=inputs,
                          reference=lambda x: ref.logprob(x["logits"], x["target"]), run=call,
                          comm=_contract(lambda ctx, s=s, op=op: logprob_comm(
                              ctx, s, None if op == "DistributedLogprob" else 2, grad=False)),
                          input_layouts={"logits": LOGITS, "target": BATCH}, output_layouts=(BATCH,), supports=_batch_divides(b)))
    return cases


def cross_entropy_cases(shapes) -> list[Case]:
    cases = []
    for b, s, v, extra in shapes:
        extra = {k: x for k, x in extra.items() if k != "masked"}

        def inputs(gen, b=b, s=s, v=v, extra=extra):
            return {"student_logits": make_logits(gen, (b, s, v), **extra),
                    "target_logits": make_logits(gen, (b, s, v), **{k: x for k, x in extra.items() if k != "neg_inf"})}

        cases.append(Case(
            op=OP + "DistributedCrossEntropy", case_id=_case_id(b, s, v, extra), params={"B": b, "S": s, "V": v, **extra},
            make_inputs=inputs, reference=lambda x: ref.cross_entropy(x["student_logits"], x["target_logits"]),
            run=lambda impl, ctx, x: impl.DistributedCrossEntropy.apply(x["student_logits"], x["target_logits"], ctx.group("tp")),
            input_layouts={"student_logits": LOGITS, "target_logits": LOGITS}, output_layouts=(BATCH,),
            grad_inputs=("student_logits",), supports=_batch_divides(b), comm=_contract(cross_entropy_comm)))
    cases.append(Case(
        op=OP + "DistributedCrossEntropy", case_id="shape-mismatch", params={"student": [2, 4, 16], "target": [2, 3, 16]},
        make_inputs=lambda gen: {"student_logits": make_logits(gen, (2, 4, 16)), "target_logits": make_logits(gen, (2, 3, 16))},
        reference=lambda x: None,
        run=lambda impl, ctx, x: impl.DistributedCrossEntropy.apply(x["student_logits"], x["target_logits"], ctx.group("tp")),
        input_layouts={"student_logits": LOGITS, "target_logits": LOGITS}, dtypes=("float64",),
        bad_input=BadInput("student logits [2, 4, 16] and target logits [2, 3, 16] of different shapes"),
        supports=_batch_divides(2)))
    return cases


def all_to_all_cases(quick: bool) -> list[Case]:
    cases = []
    shapes = [(16, 32), (24, 48)] if not quick else [(24, 48)]
    for rows, v in shapes:
        for op, layouts in (("all_to_all_vp2sq", (ROWS_VOCAB, ROWS)), ("all_to_all_sq2vp", (ROWS, ROWS_VOCAB))):
            cases.append(Case(
                op=OP + op, case_id=f"bs{rows}v{v}", params={"BS": rows, "V": v},
                make_inputs=lambda gen, rows=rows, v=v: {"logits": make_logits(gen, (rows, v))},
                reference=lambda x: x["logits"].clone(),  # a pure layout change: values are untouched
                run=lambda impl, ctx, x, op=op: getattr(impl, op)(x["logits"], ctx.group("tp")),
                input_layouts={"logits": layouts[0]}, output_layouts=(layouts[1],), comm=_contract(all_to_all_comm),
                supports=lambda t, rows=rows, v=v: (rows // t.dp) % t.tp == 0 and v % t.tp == 0))
    # Not divisible / not 2-D: no layout is documented for them, so the op must raise on every rank.
    # vp2sq splits the rows over TP, sq2vp the vocab: each must refuse a size TP does not divide.
    for op, (rows, v) in (("all_to_all_vp2sq", (6, 8)), ("all_to_all_sq2vp", (8, 6))):
        cases.append(Case(
            op=OP + op, case_id=f"bs{rows}v{v}-not-divisible", params={"BS": rows, "V": v},
            make_inputs=lambda gen, rows=rows, v=v: {"logits": make_logits(gen, (rows, v))}, reference=lambda x: None,
            run=lambda impl, ctx, x, op=op: getattr(impl, op)(x["logits"], ctx.group("tp")), dtypes=("float64",),
            bad_input=BadInput(f"[{rows}, {v}] logits whose {'rows' if op.endswith('vp2sq') else 'vocab'} TP 4 does not divide"),
            supports=lambda t: t.tp == 4 and t.dp == 1))
        cases.append(Case(
            op=OP + op, case_id="not-2d", params={"shape": [2, 4, 8]},
            make_inputs=lambda gen: {"logits": make_logits(gen, (2, 4, 8))}, reference=lambda x: None,
            run=lambda impl, ctx, x, op=op: getattr(impl, op)(x["logits"], ctx.group("tp")), dtypes=("float64",),
            bad_input=BadInput("3-D logits [2, 4, 8] (the op takes [BS, V])"), supports=lambda t: t.dp == 1))
    return cases



# ---- phase 2: the rest of model_utils on the TP axis (cp_group None everywhere) ----------
#
# Sampling (top-k/top-p) ops move [B*S, V_local] to [B*S/TP, V] with an all-to-all: they run only
# where the local B*S splits over TP and the vocab shards are even (`supports`).  Ops that take a
# `vocab_parallel_rank` (range rank*V_local) need even shards too; the others run on uneven ones.
# Sequence-parallel hidden states [S, B, H] are sharded on S over TP and on B over DP; the output
# weight [V, H] on V over TP and replicated over DP.

SEQ_HIDDEN = Layout(dp=Shard(1), tp=Shard(0))  # hidden states [S, B, H]: batch over DP, sequence over TP
WEIGHT = Layout(tp=Shard(0))  # output weight [V, H]: vocab over TP, replicated over DP



class Sampling(NamedTuple):
    top_k: int | None = None
    top_p: float = 1.0
    temperature: float = 1.0

    @property
    def filtering(self) -> bool:
        return (self.top_k is not None and self.top_k > 0) or self.top_p < 1.0

    def tag(self) -> str:
        parts = [] if self.top_k is None else [f"k{self.top_k}"]
        parts += [f"p{self.top_p:g}"] if self.top_p < 1.0 else []
        parts += [f"T{self.temperature:g}"] if self.temperature != 1.0 else []
        return "-".join(parts) or "nofilter"

    def params(self) -> dict:
        return {"top_k": self.top_k, "top_p": self.top_p, "temperature": self.temperature}


@dataclass(frozen=True)
class TrainingSamplingParams:
    """Stand-in of nemo_rl.algorithms.logits_sampling_utils.TrainingSamplingParams, the type the seed gives
    `sampling_params` (a module the seed's model_utils imports, not one of its names): what the ops read of it."""

    top_k: int | None = None
    top_p: float = 1.0
    temperature: float = 1.0


def _sampling_params(s: Sampling) -> TrainingSamplingParams:
    return TrainingSamplingParams(top_k=s.top_k, top_p=s.top_p, temperature=s.temperature)


def _all_to_all_fits(b: int, s: int, v: int):
    """Sampling layout: B divides over DP, the local B*S rows over TP, and the vocab evenly."""
    return lambda t: b % t.dp == 0 and (b // t.dp * s) % t.tp == 0 and v % t.tp == 0


def _even_vocab(b: int, v: int):
    return lambda t: b % t.dp == 0 and v % t.tp == 0


def _dtensor(ctx, local: torch.Tensor, name: str, layout: Layout) -> DTensor:
    """The DTensor whose local piece on this rank is `local` (uneven shards included).  A dim laid out by a
    CP index rule is a Shard of the (permuted) sequence, as upstream builds it."""
    shape = torch.Size(ctx.full_shapes[name])
    placements = [Shard(p.dim % len(shape)) if isinstance(p, (Shard, IndexRule)) else p for p in layout.placements]
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, ctx.mesh, placements, run_check=False, shape=shape, stride=stride)


# -- inputs

TOP_P_MARGIN = 1e-3  # cumulative probabilities stay this far from 1 - top_p: float32 vs float64 cannot flip a decision


def _bf16_exact(x: torch.Tensor) -> torch.Tensor:
    """Values every dtype under test holds exactly, so rounding the inputs cannot make or break a tie."""
    return x.to(torch.bfloat16).to(torch.float64)


def _top_p_margin(x: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """Per row: distance of the (top-k renormalised, ascending) cumulative probabilities to 1 - top_p."""
    probs = torch.softmax(ref.filter_logits(x, top_k, 1.0), dim=-1)
    cum = torch.sort(probs, dim=-1, stable=True).values.cumsum(-1)[..., :-1]  # the largest is always kept
    return (cum - (1.0 - top_p)).abs().amin(-1)


def _tie_straddles(x: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """Per id: whether it is in a group of equal logits that top-p keeps in part (docs/ops/model_utils.md#top-k--top-p-filtering lets any of
    the tied ids survive, so which ones do is the implementation's choice)."""
    top_k_kept = torch.isfinite(ref.filter_logits(x, top_k, 1.0))
    kept = torch.isfinite(ref.filter_logits(x, top_k, top_p))
    same = x[..., :, None] == x[..., None, :]
    some_kept = (same & kept[..., None, :]).any(-1)
    some_dropped = (same & (top_k_kept & ~kept)[..., None, :]).any(-1)
    return top_k_kept & some_kept & some_dropped


def _sampling_logits(gen, shape, sampling: Sampling, scale: float = 3.0, ties: bool = False,
                     tie_choice: bool = False) -> torch.Tensor:
    """bf16-exact logits whose top-p decisions are not on a knife edge (rows too close are redrawn), and,
    unless `tie_choice`, whose tied logits top-p keeps all or none of (so every valid implementation
    gives the same values and gradients)."""
    logits = _bf16_exact(make_logits(gen, shape, scale, ties))
    if sampling.top_p >= 1.0:
        return logits
    for _ in range(200):
        scaled = logits / sampling.temperature
        bad = _top_p_margin(scaled, sampling.top_k, sampling.top_p) < TOP_P_MARGIN
        if not tie_choice:
            bad |= _tie_straddles(scaled, sampling.top_k, sampling.top_p).any(-1)
        if not bad.any():
            return logits
        logits[bad] = _bf16_exact(make_logits(gen, (int(bad.sum()), shape[-1]), scale, ties))
    raise RuntimeError(f"could not draw logits {shape} away from the top_p={sampling.top_p} edges")


def _mask_ids(gen, ids: torch.Tensor, vocab: int, masked: float) -> torch.Tensor:
    """`masked` of the ids -100 and a quarter as many V+3: both outside [0, V) (0, no gradient)."""
    if not masked:
        return ids
    r = torch.rand(ids.shape, generator=gen)
    ids = torch.where(r < masked, -100, ids)
    return torch.where((r >= masked) & (r < masked * 1.25), vocab + 3, ids)


def _sampling_inputs(gen, b, s, v, sampling: Sampling, scale=3.0, ties=False, masked=0.0, shift=False,
                     tie_choice=False):
    """Logits and targets: a third of the targets on their row's argmax (the last of tied maxima), a
    third among the row's 3 largest logits, a third uniform (often filtered out: logprob -inf)."""
    logits = _sampling_logits(gen, (b, s, v), sampling, scale, ties, tie_choice)
    target = torch.randint(0, v, (b, s), generator=gen)
    top3 = logits.topk(3, dim=-1).indices.gather(-1, torch.randint(0, 3, (b, s, 1), generator=gen)).squeeze(-1)
    last_argmax = v - 1 - logits.flip(-1).argmax(-1)
    r = torch.rand((b, s), generator=gen)
    target = torch.where(r < 1 / 3, last_argmax, torch.where(r < 2 / 3, top3, target))
    target = _mask_ids(gen, target, v, masked)
    if shift:  # next-token ops score target[t+1] with logits[t]
        target = target.roll(1, dims=1)
    return {"logits": logits, "target": target}


def _make_indices(gen, b, s, k, v, dup: bool = True, masked: float = 0.0) -> torch.Tensor:
    """[B,S,K] global ids; `dup`: the last id repeats the first (and a third of positions repeat one id K times)."""
    idx = torch.randint(0, v, (b, s, k), generator=gen)
    if dup:
        idx[..., -1] = idx[..., 0]
        same = torch.rand((b, s), generator=gen) < 1 / 3
        idx = torch.where(same[..., None], idx[..., :1].expand(b, s, k), idx)
    return _mask_ids(gen, idx, v, masked)


# -- properties

def _props(*fns):
    fns = [f for f in fns if f is not None]
    if not fns:
        return None
    return lambda ctx, full, local, outs: [p for f in fns for p in f(ctx, full, local, outs)]


def _finite_scale(t: torch.Tensor) -> float:
    t = t[torch.isfinite(t)]
    return float(t.abs().max()) if t.numel() else 0.0


def _close(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float) -> Property:
    """got == want up to rtol * max(1, |want|max); -inf/NaN positions exactly the same."""
    if got.shape != want.shape:
        return Property(name, False, None, f"shape {tuple(got.shape)} vs {tuple(want.shape)}")
    g, w = got.detach().double(), want.detach().double()
    fin = torch.isfinite(g) & torch.isfinite(w)
    same_nonfinite = (~torch.isfinite(g) & ~torch.isfinite(w) & ((g == w) | (g.isnan() & w.isnan()))) | fin
    if not same_nonfinite.all():
        i = tuple(int(j) for j in (~same_nonfinite).nonzero()[0])
        return Property(name, False, None, f"non-finite mismatch at {i}: {float(g[i])} vs {float(w[i])}")
    err = float((g - w)[fin].abs().max()) if fin.any() else 0.0
    tol = rtol * max(1.0, _finite_scale(w))
    return Property(name, err <= tol, err, f"max |chunked - unchunked| {err:.3g} (tolerance {tol:.3g})")


def _chunked_equals_unchunked(unchunked, eps_of=None, factor: float = 16.0):
    """property chunked_equals_unchunked: the op's first output equals the unchunked op's on the same
    rank's inputs.  `unchunked(impl, ctx, detached_inputs)`; tolerance factor * eps of the output
    dtype (or of `eps_of(ctx)`)."""
    def prop(ctx, full, local, outs):
        inputs = {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in local.items()}
        with torch.no_grad():
            want = unchunked(ctx.impl, ctx, inputs)
        eps = torch.finfo(eps_of(ctx) if eps_of else outs[0].dtype).eps
        return [_close("chunked_equals_unchunked", outs[0], want, factor * eps)]
    return prop


def _survivors_sum_to_1(call, v: int):
    """property survivors_sum_to_1: per position, the op's probabilities of all V ids sum to 1 (filtered
    ids contribute exp(-inf) = 0).  One call on the batch repeated V times, target v in copy v.
    `call(impl, ctx, logits, target)`."""
    def prop(ctx, full, local, outs):
        logits, target = local["logits"].detach(), local["target"]
        b, s = target.shape
        ids = torch.arange(v, device=target.device).view(v, 1, 1).expand(v, b, s).reshape(v * b, s)
        with torch.no_grad():
            lp = call(ctx.impl, ctx, logits.repeat(v, 1, 1), ids)
        total = lp.double().exp().view(v, b, -1).sum(0)
        err = float((total - 1).abs().max())
        tol = 4 * v * torch.finfo(lp.dtype).eps
        return [Property("survivors_sum_to_1", err <= tol, err,
                         f"max |sum_v p_v - 1| {err:.3g} over survivors (tolerance {tol:.3g})")]
    return prop


def _entropy_nonpositive(ctx, full, local, outs):
    h = outs[0].detach()
    bad = ~(h <= 0)  # NaN counts as bad
    worst = float(h[torch.isfinite(h)].max()) if torch.isfinite(h).any() else float("nan")
    msg = f"max H_all {worst:.3g}" + (f"; {int(bad.sum())} position(s) > 0 or NaN, first at "
                                      f"{tuple(int(i) for i in bad.nonzero()[0])}" if bad.any() else "")
    return [Property("entropy_nonpositive", not bool(bad.any()), worst, msg)]


def _any_tied_survivor(smp: Sampling):
    """Forward check of a top-p case with tied logits at the boundary: the golden's values, except where
    the target is in a tie group that top-p keeps in part: there it may have survived (its log-prob over
    the kept set, the same whichever tied ids are kept) or not (-inf)."""
    def check(got, expected, full, local, ctx):
        x = BATCH.local(full["logits"], ctx.mesh).double() / smp.temperature
        target = BATCH.local(full["target"], ctx.mesh).long()
        V = x.shape[-1]
        valid = (target >= 0) & (target < V)
        t = target.clamp(0, V - 1)[..., None]
        open_choice = valid & _tie_straddles(x, smp.top_k, smp.top_p).gather(-1, t).squeeze(-1)
        if_kept = x.gather(-1, t).squeeze(-1) - torch.logsumexp(ref.filter_logits(x, smp.top_k, smp.top_p), -1)
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
            return False, f"got {getattr(got, 'shape', type(got).__name__)}, expected shape {tuple(expected.shape)}"
        g, e = got.detach().double().cpu(), expected.double()
        tol = 64 * torch.finfo(got.dtype).eps * max(1.0, _finite_scale(e))
        def near(a, b):
            return (a == b) | ((a - b).abs() <= tol)
        ok = near(g, e) | (open_choice & ((g == float("-inf")) | near(g, if_kept)))
        if not ok.all():
            i = tuple(int(j) for j in (~ok).nonzero()[0])
            return False, (f"{int((~ok).sum())} position(s) wrong, first at local {i}: expected {float(e[i])}"
                           + (f" or {float(if_kept[i])} or -inf (tied at the top-p boundary)" if open_choice[i] else "")
                           + f", got {float(g[i])}")
        return True, f"{int(open_choice.sum())} target(s) tied at the top-p boundary; any tied survivor accepted"
    return check


# -- DistributedLogprobWithSampling / ChunkedDistributedLogprobWithSampling

# (B, S, V, extra, sampling): every shape splits B*S over TP 8 and has V divisible by 8.
SAMPLING_SPECS = [
    (4, 6, 32, {}, Sampling(top_k=5)),  # top-k only
    (4, 6, 32, {"masked": 0.2}, Sampling(top_p=0.8)),  # top-p only
    (2, 8, 48, {"ties": True, "masked": 0.2}, Sampling(top_k=5, top_p=0.9)),  # both; ties at the k-th logit
    (2, 8, 48, {}, Sampling(top_k=0)),  # neither (top_k <= 0 disables)
    (2, 4, 16, {"scale": 300.0}, Sampling(top_k=3, top_p=0.7)),  # huge logits
    # only one of the tied maxima survives, any of them (forward only: which one decides the gradient)
    (2, 8, 48, {"ties": True, "tie_choice": True}, Sampling(top_p=1e-6)),
]
QUICK_SAMPLING = [SAMPLING_SPECS[2], SAMPLING_SPECS[5]]


def sampling_cases(quick: bool) -> list[Case]:
    cases = []
    specs = QUICK_SAMPLING if quick else SAMPLING_SPECS
    for n, (b, s, v, extra, smp) in enumerate(specs):
        params = {"B": b, "S": s, "V": v, **extra, **smp.params()}
        inputs = partial(lambda gen, b, s, v, smp, extra: _sampling_inputs(gen, b, s, v, smp, **extra),
                         b=b, s=s, v=v, smp=smp, extra=extra)
        reference = partial(lambda x, smp: ref.sampling_logprob(x["logits"], x["target"], smp.top_k, smp.top_p), smp=smp)

        def plain(impl, ctx, logits, target, smp=smp, inference_only=False):
            return impl.DistributedLogprobWithSampling.apply(logits, target, ctx.group("tp"), smp.top_k, smp.top_p,
                                                             inference_only)

        def chunked(impl, ctx, logits, target, chunk, smp=smp, inference_only=False):
            return impl.ChunkedDistributedLogprobWithSampling.apply(logits, target, ctx.group("tp"), smp.top_k,
                                                                    smp.top_p, chunk, inference_only)

        common = dict(make_inputs=inputs, reference=reference, input_layouts={"logits": LOGITS, "target": BATCH},
                      output_layouts=(BATCH,), grad_inputs=("logits",), supports=_all_to_all_fits(b, s, v))
        if extra.get("tie_choice"):
            common.update(grad_inputs=(), output_checks={"out": _any_tied_survivor(smp)})
        cid = f"{_case_id(b, s, v, extra)}-{smp.tag()}"
        cases.append(Case(
            op=OP + "DistributedLogprobWithSampling", case_id=cid, params=params,
            run=lambda impl, ctx, x, plain=plain: plain(impl, ctx, x["logits"], x["target"]),
            properties=_survivors_sum_to_1(lambda impl, ctx, l, t, plain=plain: plain(impl, ctx, l, t, inference_only=True), v),
            comm=_contract(lambda ctx: sampling_comm(ctx, None, ctx.dtype.itemsize)), **common))
        # 3 does not divide S; 1 and 64 (a single chunk) on the first spec only
        for chunk in ([3] if quick or n else [3, 1, 64]):
            cases.append(Case(
                op=OP + "ChunkedDistributedLogprobWithSampling", case_id=f"{cid}-chunk{chunk}",
                params={**params, "chunk_size": chunk},
                comm=_contract(lambda ctx, chunk=chunk: sampling_comm(ctx, chunk, ctx.dtype.itemsize)),
                run=lambda impl, ctx, x, chunked=chunked, chunk=chunk: chunked(impl, ctx, x["logits"], x["target"], chunk),
                properties=_props(
                    _survivors_sum_to_1(lambda impl, ctx, l, t, chunked=chunked, chunk=chunk:
                                        chunked(impl, ctx, l, t, chunk, inference_only=True), v),
                    _chunked_equals_unchunked(lambda impl, ctx, x, plain=plain:
                                              plain(impl, ctx, x["logits"], x["target"], inference_only=True))),
                **common))
    # B*S = 3 rows do not split over TP 2, 4, 8: the op raises, or pads the rows and returns the same log-probs
    # (the result [B, S] does not depend on how the rows were laid out), gradients included.
    smp = Sampling(top_k=4)
    for op, extra_args in (("DistributedLogprobWithSampling", ()), ("ChunkedDistributedLogprobWithSampling", (2,))):
        cases.append(Case(
            op=OP + op, case_id="b1s3v16-bs-not-divisible", params={"B": 1, "S": 3, "V": 16, "top_k": 4},
            make_inputs=lambda gen: _sampling_inputs(gen, 1, 3, 16, smp),
            reference=lambda x: ref.sampling_logprob(x["logits"], x["target"], smp.top_k, smp.top_p),
            run=lambda impl, ctx, x, op=op, extra_args=extra_args: getattr(impl, op).apply(
                x["logits"], x["target"], ctx.group("tp"), smp.top_k, smp.top_p, *extra_args),
            input_layouts={"logits": LOGITS, "target": BATCH}, output_layouts=(BATCH,), grad_inputs=("logits",),
            dtypes=("float64",), supports=lambda t: t.dp == 1 and 3 % t.tp != 0,
            bad_input=BadInput("B·S = 3 rows that TP does not divide",
                               interpretation="the rows padded to a multiple of TP: the same [B, S] log-probs")))
    return cases


# -- ChunkedDistributedGatherLogprob, gather_logits_at_global_indices, distributed_vocab_topk

# (B, S, V, K, extra, chunk): V=37/33 uneven shards; V=20 leaves TP rank 7 of 8 an empty shard.
GATHER_SPECS = [
    (4, 6, 37, 4, {"masked": 0.2}, 4),  # chunk 4 does not divide S
    (2, 8, 48, 6, {}, 3),
    (2, 5, 33, 3, {"scale": 300.0}, 2),  # huge logits
    (4, 4, 24, 5, {"ties": True, "neg_inf": 0.2}, 1),  # ids on -inf logits: logprob -inf
    (2, 8, 20, 5, {}, 64),  # a single chunk
]
QUICK_GATHER = [GATHER_SPECS[0], GATHER_SPECS[4]]


def _gather_inputs(gen, b, s, v, k, extra):
    logits = make_logits(gen, (b, s, v), **{key: x for key, x in extra.items() if key != "masked"})
    return {"logits": logits, "indices": _make_indices(gen, b, s, k, v, dup=True, masked=extra.get("masked", 0.0))}


def gather_logprob_cases(quick: bool) -> list[Case]:
    cases = []
    for b, s, v, k, extra, chunk in QUICK_GATHER if quick else GATHER_SPECS:
        def call(impl, ctx, x, chunk, inference_only=False):
            return impl.ChunkedDistributedGatherLogprob.apply(x["logits"], x["indices"], *_vocab_range(ctx), chunk,
                                                              ctx.group("tp"), inference_only)
        cases.append(Case(
            op=OP + "ChunkedDistributedGatherLogprob", case_id=f"{_case_id(b, s, v, extra)}-k{k}-dup-chunk{chunk}",
            params={"B": b, "S": s, "V": v, "K": k, "duplicates": True, "chunk_size": chunk, **extra},
            make_inputs=partial(_gather_inputs, b=b, s=s, v=v, k=k, extra=extra),
            reference=lambda x: ref.gather_logprob(x["logits"], x["indices"]),
            run=lambda impl, ctx, x, call=call, chunk=chunk: call(impl, ctx, x, chunk),
            input_layouts={"logits": LOGITS, "indices": BATCH}, output_layouts=(BATCH,), grad_inputs=("logits",),
            comm=_contract(lambda ctx, s=s, chunk=chunk, k=k: logprob_comm(ctx, s, chunk, k=k)),
            properties=_chunked_equals_unchunked(lambda impl, ctx, x, call=call, s=s: call(impl, ctx, x, s, True)),
            supports=_batch_divides(b)))
    return cases


def gather_logits_cases(quick: bool) -> list[Case]:
    """TP-sharded logits, and tp_group=None: every rank holds the full vocab (logits replicated over TP)."""
    specs = [(4, 6, 37, 5, {"masked": 0.2}, "tp", None), (2, 8, 48, 4, {"scale": 300.0}, "tp", 3),
             (4, 6, 32, 5, {"masked": 0.2}, "none", None),
             # ids on -inf logits: the owner's -inf must come through the TP sum, with no NaN from a
             # non-owner's -inf x 0
             (4, 6, 37, 5, {"neg_inf": 0.3}, "tp", None)]
    cases = []
    for b, s, v, k, extra, group, chunk in [specs[0], specs[2], specs[3]] if quick else specs:
        if group == "tp":
            run = lambda impl, ctx, x, chunk=chunk: impl.gather_logits_at_global_indices(
                x["logits"], x["indices"], ctx.group("tp"), None, vocab_start_index=_vocab_range(ctx)[0],
                vocab_end_index=_vocab_range(ctx)[1], chunk_size=chunk)
        else:
            run = lambda impl, ctx, x, v=v: impl.gather_logits_at_global_indices(
                x["logits"], x["indices"], None, None, vocab_start_index=0, vocab_end_index=v)
        cases.append(Case(
            op=OP + "gather_logits_at_global_indices",
            case_id=f"{_case_id(b, s, v, extra)}-k{k}-dup-tp_group_{group}" + (f"-chunk{chunk}" if chunk else ""),
            params={"B": b, "S": s, "V": v, "K": k, "duplicates": True, "tp_group": group, "chunk_size": chunk, **extra},
            make_inputs=partial(_gather_inputs, b=b, s=s, v=v, k=k, extra=extra),
            reference=lambda x: ref.gather_logits(x["logits"], x["indices"]), run=run,
            comm=_contract(lambda ctx, k=k: gather_logits_comm(ctx, k)) if group == "tp" else NO_COMM,
            input_layouts={"logits": LOGITS if group == "tp" else BATCH, "indices": BATCH}, output_layouts=(BATCH,),
            grad_inputs=("logits",), supports=_batch_divides(b)))
    return cases


def _topk_values_exact(got, expected, full, local, ctx):
    """Values: exactly torch.topk of the full logits, in the compute dtype."""
    want_dtype = torch.promote_types(ctx.dtype, torch.float32)
    if not isinstance(got, torch.Tensor) or got.dtype != want_dtype or got.shape != expected.shape:
        what = f"{got.dtype} {tuple(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__
        return False, f"got {what}, expected {want_dtype} {tuple(expected.shape)}"
    diff = got.double() != expected
    if diff.any():
        i = tuple(int(j) for j in diff.nonzero()[0])
        return False, f"{int(diff.sum())} value(s) differ from torch.topk, first at local {i}: expected {float(expected[i])}, got {float(got[i])}"
    return True, "values equal torch.topk exactly"


def _topk_ids_valid(got, expected, full, local, ctx):
    """Ids: any ids are right whose logits equal the top-k values (ties), distinct and in [0, V)."""
    logits = BATCH.local(full["logits"], ctx.mesh).double()  # this rank's batch rows, full vocab
    V = logits.shape[-1]
    values = torch.topk(logits, expected.shape[-1], dim=-1).values
    if not isinstance(got, torch.Tensor) or got.dtype != torch.int64 or got.shape != expected.shape:
        what = f"{got.dtype} {tuple(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__
        return False, f"got {what}, expected int64 {tuple(expected.shape)}"
    got = got.cpu()
    if ((got < 0) | (got >= V)).any():
        i = tuple(int(j) for j in ((got < 0) | (got >= V)).nonzero()[0])
        return False, f"id {int(got[i])} outside [0, {V}) at local {i}"
    dup = (got.sort(-1).values.diff(dim=-1) == 0).any(-1)
    if dup.any():
        i = tuple(int(j) for j in dup.nonzero()[0])
        return False, f"{int(dup.sum())} position(s) with a repeated id, first at local {i}: {got[i].tolist()}"
    picked = logits.gather(-1, got)
    bad = picked != values
    if bad.any():
        i = tuple(int(j) for j in bad.nonzero()[0])
        return False, (f"{int(bad.sum())} id(s) whose logit is not the top-k value, first at local {i}: "
                       f"id {int(got[i])} has logit {float(picked[i])}, expected value {float(values[i])}")
    return True, "every id's logit equals its top-k value"


# (B, S, V, k, extra, chunk)
TOPK_SPECS = [
    (4, 6, 16, 10, {"ties": True}, None),  # k > V_local from TP 2 on; ties at the boundary
    (2, 8, 16, 16, {}, 3),  # k = V; chunk 3 does not divide S
    (2, 8, 48, 5, {"ties": True}, 3),  # ties at the k-th value
    (2, 5, 37, 4, {"scale": 300.0}, None),  # uneven shards, huge logits
    (2, 4, 6, 6, {"ties": True}, None),  # k = V with empty shards at TP 4 and 8
    (2, 4, 20, 20, {"neg_inf": 0.3}, 2),  # -inf among the top k (ties of -inf); TP 8: an empty shard
]
QUICK_TOPK = [TOPK_SPECS[0], TOPK_SPECS[4]]


def topk_cases(quick: bool) -> list[Case]:
    cases = []
    for b, s, v, k, extra, chunk in QUICK_TOPK if quick else TOPK_SPECS:
        cases.append(Case(
            op=OP + "distributed_vocab_topk", case_id=f"{_case_id(b, s, v, extra)}-k{k}" + (f"-chunk{chunk}" if chunk else ""),
            params={"B": b, "S": s, "V": v, "k": k, "chunk_size": chunk, **extra},
            make_inputs=lambda gen, b=b, s=s, v=v, extra=extra: {"logits": make_logits(gen, (b, s, v), **extra)},
            reference=lambda x, k=k: ref.vocab_topk(x["logits"], k),
            run=lambda impl, ctx, x, k=k, chunk=chunk: impl.distributed_vocab_topk(
                x["logits"], k, ctx.group("tp"), vocab_start_index=_vocab_range(ctx)[0],
                vocab_end_index=_vocab_range(ctx)[1], chunk_size=chunk),
            input_layouts={"logits": LOGITS}, output_layouts=(BATCH, BATCH), output_names=("values", "ids"),
            output_checks={"values": _topk_values_exact, "ids": _topk_ids_valid}, supports=_batch_divides(b),
            comm=_contract(lambda ctx, s=s, k=k, chunk=chunk: topk_comm(ctx, s, k, chunk))))
    return cases


# -- get_distillation_topk_logprobs_from_logits, ChunkedDistributedEntropy

def _distill_inputs(gen, b, s, v, k, extra):
    teacher = make_logits(gen, (b, s, k)).sort(dim=-1, descending=True).values  # a teacher's top-k logits
    ids = torch.rand((b, s, v), generator=gen).argsort(dim=-1)[..., :k]  # distinct ids, as top-k gives
    return {"student_logits": make_logits(gen, (b, s, v), **extra), "teacher_topk_logits": teacher,
            "teacher_topk_indices": ids}


def distillation_cases(quick: bool) -> list[Case]:
    # (B, S, V, K, extra, zero_outside_topk, calculate_entropy, path)
    specs = [(2, 8, 32, 4, {}, z, e, "group") for z in (False, True) for e in (False, True)]
    specs += [(2, 8, 32, 4, {"scale": 300.0}, False, True, "group"),  # huge logits
              (4, 6, 37, 5, {}, True, True, "dtensor"),  # uneven shards through the DTensor
              (4, 6, 24, 5, {"ties": True}, False, True, "plain"),  # full vocab on every rank
              (4, 6, 24, 5, {"neg_inf": 0.3}, False, True, "group"),  # -inf among the K ids and the vocab
              (4, 6, 24, 5, {"neg_inf": 0.3}, True, False, "group")]
    if quick:
        specs = [specs[1], specs[3]]
    cases = []
    for b, s, v, k, extra, zero, ent, path in specs:
        def run(impl, ctx, x, zero=zero, ent=ent, path=path):
            student, kw = x["student_logits"], {}
            if path == "group":
                kw = dict(vocab_parallel_rank=ctx.rank("tp"), vocab_parallel_group=ctx.group("tp"))
            elif path == "dtensor":
                student = _dtensor(ctx, student, "student_logits", LOGITS)
            return impl.get_distillation_topk_logprobs_from_logits(
                student, x["teacher_topk_logits"], x["teacher_topk_indices"], zero, ent, **kw)

        def reference(x, zero=zero, ent=ent):
            st, te, h = ref.distillation_topk_logprobs(x["student_logits"], x["teacher_topk_logits"],
                                                       x["teacher_topk_indices"], zero, ent)
            return st, te, h  # H_all None without calculate_entropy: the op must return None too

        cases.append(Case(
            op=OP + "get_distillation_topk_logprobs_from_logits",
            case_id=f"{_case_id(b, s, v, extra)}-k{k}-zero_outside_{zero}-entropy_{ent}-{path}",
            params={"B": b, "S": s, "V": v, "K": k, "zero_outside_topk": zero, "calculate_entropy": ent, "path": path, **extra},
            make_inputs=partial(_distill_inputs, b=b, s=s, v=v, k=k, extra=extra), reference=reference, run=run,
            input_layouts={"student_logits": BATCH if path == "plain" else LOGITS, "teacher_topk_logits": BATCH,
                           "teacher_topk_indices": BATCH},
            output_layouts=(BATCH, BATCH, BATCH if ent else REPLICATED), output_names=("student", "teacher", "H_all"),
            grad_inputs=("student_logits", "teacher_topk_logits"),
            comm=NO_COMM if path == "plain" else _contract(
                lambda ctx, s=s, k=k, zero=zero, ent=ent: distillation_comm(ctx, s, k, zero, ent)),
            supports=_even_vocab(b, v) if path == "group" else _batch_divides(b)))
    return cases


def _huge_logits_close_top(gen, shape, scale: float = 300.0) -> torch.Tensor:
    """Huge logits (x100) with ~15% of each row's ids moved to within 6 of the row's max: the max
    subtraction is stressed, yet the softmax is not one-hot everywhere.  (When every row is one-hot
    the entropy gradient is ~1e-17 and the float64 golden, differentiated by autograd through
    p log p, is off by ~eps * p in absolute terms: see the report of this issue.)"""
    logits = torch.randn(shape, generator=gen, dtype=torch.float64) * scale
    close = torch.rand(shape, generator=gen) < 0.15
    runner_up = logits.amax(-1, keepdim=True) - 6 * torch.rand(shape, generator=gen, dtype=torch.float64)
    return torch.where(close, runner_up, logits)


# (B, S, V, extra, chunk)
ENTROPY_SPECS = [
    (4, 6, 37, {}, 4),  # uneven shards; chunk 4 does not divide S
    (2, 8, 48, {}, 1),
    (2, 5, 33, {"huge_close_top": True}, 2),  # huge logits
    (4, 7, 40, {"neg_inf": 0.2}, 64),  # p = 0 terms; a single chunk
    (4, 8, 20, {"ties": True}, 3),  # TP 8: an empty shard
]
QUICK_ENTROPY = [ENTROPY_SPECS[0], ENTROPY_SPECS[2]]


def _entropy_logits(gen, b, s, v, extra):
    if extra.get("huge_close_top"):
        return _huge_logits_close_top(gen, (b, s, v))
    return make_logits(gen, (b, s, v), **extra)


def entropy_cases(quick: bool) -> list[Case]:
    cases = []
    for b, s, v, extra, chunk in QUICK_ENTROPY if quick else ENTROPY_SPECS:
        cases.append(Case(
            op=OP + "ChunkedDistributedEntropy", case_id=f"{_case_id(b, s, v, extra)}-chunk{chunk}",
            params={"B": b, "S": s, "V": v, "chunk_size": chunk, **extra},
            make_inputs=lambda gen, b=b, s=s, v=v, extra=extra: {"logits": _entropy_logits(gen, b, s, v, extra)},
            reference=lambda x: ref.entropy(x["logits"]),
            run=lambda impl, ctx, x, chunk=chunk: impl.ChunkedDistributedEntropy.apply(
                x["logits"], chunk, ctx.group("tp")),
            input_layouts={"logits": LOGITS}, output_layouts=(BATCH,), grad_inputs=("logits",),
            comm=_contract(lambda ctx, s=s, chunk=chunk: entropy_comm(ctx, s, chunk)),
            properties=_props(_entropy_nonpositive, _chunked_equals_unchunked(
                lambda impl, ctx, x, s=s: impl.ChunkedDistributedEntropy.apply(x["logits"], s, ctx.group("tp"), True))),
            supports=_batch_divides(b)))
    return cases


# -- hidden states -> logprobs

def _hidden_inputs(gen, s, b, h, v, scale=1.0, masked=0.0):
    """hidden [S,B,H], weight [V,H] (logits ~ N(0, H) * scale^2) and target ids [B,S]."""
    return {"hidden": torch.randn((s, b, h), generator=gen, dtype=torch.float64) * scale,
            "weight": torch.randn((v, h), generator=gen, dtype=torch.float64) * scale,
            "target": make_targets(gen, (b, s), v, masked)}


def _hidden_logits(x):
    """The reference's LM-head projection: [S,B,H] x [V,H] -> [B,S,V] in the input dtype."""
    return torch.matmul(x["hidden"].transpose(0, 1), x["weight"].t())


def hidden_states_cases(quick: bool) -> list[Case]:
    # (S, B, H, V, extra, chunk, weight passed as): S divisible by 8 runs on TP 8; V=37 uneven weight shards.
    chunked_specs = [(8, 2, 8, 32, {}, 3), (4, 4, 6, 37, {"masked": 0.2}, 64), (8, 2, 8, 24, {"scale": 10.0}, 2)]
    fp_specs = [(8, 2, 8, 32, {}, None, "output_weight"), (8, 2, 8, 32, {}, 3, "layer_module"),
                (4, 4, 6, 37, {"masked": 0.2}, 3, "layer_tensor")]
    if quick:
        chunked_specs, fp_specs = chunked_specs[:1], fp_specs[1:2]
    common = dict(input_layouts={"hidden": SEQ_HIDDEN, "weight": WEIGHT, "target": BATCH}, output_layouts=(BATCH,),
                  grad_inputs=("hidden", "weight"))
    input_dtype_eps = lambda ctx: ctx.dtype  # the projection runs in the input dtype: chunking may round it differently
    cases = []
    for s, b, h, v, extra, chunk in chunked_specs:
        def call(impl, ctx, x, chunk, inference_only=False):
            weight = GradSum.apply(x["weight"], (ctx.group("dp"),))
            return impl.ChunkedDistributedHiddenStatesToLogprobs.apply(
                x["hidden"], x["target"], weight, *ctx.local_range("weight", 0), chunk, ctx.group("tp"), inference_only)
        cases.append(Case(
            op=OP + "ChunkedDistributedHiddenStatesToLogprobs", case_id=f"s{s}b{b}h{h}v{v}" + _extra_tag(extra) + f"-chunk{chunk}",
            params={"S": s, "B": b, "H": h, "V": v, "chunk_size": chunk, **extra},
            make_inputs=partial(_hidden_inputs, s=s, b=b, h=h, v=v, **extra),
            reference=lambda x: ref.logprob(_hidden_logits(x), x["target"]),  # target already shifted
            run=lambda impl, ctx, x, call=call, chunk=chunk: call(impl, ctx, x, chunk),
            properties=_chunked_equals_unchunked(lambda impl, ctx, x, call=call, s=s: call(impl, ctx, x, s, True),
                                                 eps_of=input_dtype_eps),
            comm=_contract(lambda ctx, s=s, chunk=chunk: hidden_comm(ctx, s, chunk)),
            supports=lambda t, s=s, b=b: s % t.tp == 0 and b % t.dp == 0, **common))
    for s, b, h, v, extra, chunk, via in fp_specs:
        def call(impl, ctx, x, chunk, via=via, inference_only=False):
            weight = GradSum.apply(x["weight"], (ctx.group("dp"),))
            layer, out_weight = {"output_weight": (None, weight), "layer_module": (SimpleNamespace(weight=weight), None),
                                 "layer_tensor": (weight, None)}[via]
            return impl.from_parallel_hidden_states_to_logprobs(
                x["hidden"], layer, out_weight, False, x["target"], *ctx.local_range("weight", 0), ctx.group("tp"),
                inference_only=inference_only, cp_group=None, chunk_size=chunk)
        cases.append(Case(
            op=OP + "from_parallel_hidden_states_to_logprobs",
            case_id=f"s{s}b{b}h{h}v{v}" + _extra_tag(extra) + f"-chunk{chunk}-{via}",
            params={"S": s, "B": b, "H": h, "V": v, "chunk_size": chunk, "weight_via": via, **extra},
            make_inputs=partial(_hidden_inputs, s=s, b=b, h=h, v=v, **extra),
            reference=lambda x: ref.hidden_states_to_logprobs(x["hidden"], x["weight"], x["target"]),
            run=lambda impl, ctx, x, call=call, chunk=chunk: call(impl, ctx, x, chunk),
            properties=None if chunk is None else _chunked_equals_unchunked(
                lambda impl, ctx, x, call=call: call(impl, ctx, x, None, inference_only=True), eps_of=input_dtype_eps),
            comm=_contract(lambda ctx, s=s, chunk=chunk: hidden_comm(ctx, s, chunk)),
            supports=lambda t, s=s, b=b: s % t.tp == 0 and b % t.dp == 0, **common))
    return cases


def _extra_tag(extra: dict) -> str:
    return "".join(f"-{k}{'' if x is True else x}" for k, x in extra.items())


# -- from_parallel_logits_to_logprobs with sampling_params and the front ends over it

def _next_token_reference(smp: Sampling):
    if smp == Sampling():
        return lambda x: ref.next_token_logprobs(x["logits"], x["target"])
    return lambda x: ref.next_token_sampling_logprobs(x["logits"], x["target"], smp.top_k, smp.top_p, smp.temperature)


def _next_token_supports(b, s, v, smp: Sampling, even: bool = False):
    if smp.filtering:
        return _all_to_all_fits(b, s, v)
    return _even_vocab(b, v) if even else _batch_divides(b)


# (B, S, V, extra, sampling, chunk)
FP_SAMPLING_SPECS = [
    (4, 6, 32, {}, Sampling(top_k=5, temperature=0.7), None),
    (2, 8, 48, {"ties": True, "masked": 0.2}, Sampling(top_k=5, top_p=0.9, temperature=1.5), 3),
    (2, 8, 48, {}, Sampling(top_p=1e-6, temperature=0.5), None),  # argmax only
    (4, 6, 37, {"masked": 0.2}, Sampling(temperature=2.0), None),  # temperature only: no all-to-all, uneven shards
    (4, 6, 37, {}, Sampling(temperature=0.6), 4),
    (2, 4, 16, {"scale": 300.0}, Sampling(top_k=3, top_p=0.7, temperature=0.8), 2),  # huge logits
]
QUICK_FP_SAMPLING = [FP_SAMPLING_SPECS[1], FP_SAMPLING_SPECS[3]]


def from_parallel_sampling_cases(quick: bool) -> list[Case]:
    cases = []
    for b, s, v, extra, smp, chunk in QUICK_FP_SAMPLING if quick else FP_SAMPLING_SPECS:
        def call(impl, ctx, logits, target, chunk, smp=smp, inference_only=False):
            return impl.from_parallel_logits_to_logprobs(
                logits, target, *_vocab_range(ctx), ctx.group("tp"), inference_only=inference_only, cp_group=None,
                chunk_size=chunk, sampling_params=_sampling_params(smp))
        props = [_survivors_sum_to_1(lambda impl, ctx, l, t, call=call, chunk=chunk: call(impl, ctx, l, t, chunk, inference_only=True), v)
                 if smp.filtering else None]
        if chunk is not None:
            props.append(_chunked_equals_unchunked(
                lambda impl, ctx, x, call=call: call(impl, ctx, x["logits"], x["target"], None, inference_only=True)))
        cases.append(Case(
            op=OP + "from_parallel_logits_to_logprobs", case_id=f"{_case_id(b, s, v, extra)}-{smp.tag()}-chunk{chunk}",
            params={"B": b, "S": s, "V": v, "chunk_size": chunk, **extra, **smp.params()},
            make_inputs=partial(lambda gen, b, s, v, smp, extra: _sampling_inputs(gen, b, s, v, smp, shift=True, **extra),
                                b=b, s=s, v=v, smp=smp, extra=extra),
            reference=_next_token_reference(smp),
            run=lambda impl, ctx, x, call=call, chunk=chunk: call(impl, ctx, x["logits"], x["target"], chunk),
            input_layouts={"logits": LOGITS, "target": BATCH}, output_layouts=(BATCH,), grad_inputs=("logits",),
            properties=_props(*props), supports=_next_token_supports(b, s, v, smp),
            comm=_contract(lambda ctx, s=s, smp=smp, chunk=chunk: next_token_comm(ctx, s, smp, chunk))))
    return cases


def front_end_cases(quick: bool) -> list[Case]:
    """get_logprobs_from_vocab_parallel_logits (DTensor logits), get_next_token_logprobs_from_logits (its three
    dispatch cases) and dtensor_from_parallel_logits_to_logprobs, all without CP."""
    ids_layout = BATCH
    # (op, variant, B, S, V, extra, sampling, chunk)
    specs = [
        ("get_logprobs_from_vocab_parallel_logits", "dtensor_ids", 4, 6, 37, {"masked": 0.2}, Sampling(), None),
        ("get_logprobs_from_vocab_parallel_logits", "tp_sharded", 2, 8, 48, {}, Sampling(top_k=5, top_p=0.9, temperature=0.7), 3),
        ("get_logprobs_from_vocab_parallel_logits", "vocab_replicated", 4, 6, 32, {}, Sampling(top_k=4, temperature=1.3), None),
        ("get_next_token_logprobs_from_logits", "vocab_parallel_group", 4, 6, 32, {"masked": 0.2}, Sampling(), None),
        ("get_next_token_logprobs_from_logits", "vocab_parallel_group", 2, 8, 48, {"ties": True}, Sampling(top_k=5, top_p=0.9, temperature=0.7), None),
        ("get_next_token_logprobs_from_logits", "dtensor", 4, 6, 37, {}, Sampling(temperature=1.5), None),
        ("get_next_token_logprobs_from_logits", "plain", 4, 6, 32, {}, Sampling(top_k=5, top_p=0.8, temperature=1.5), None),
        ("dtensor_from_parallel_logits_to_logprobs", "plain_target", 4, 6, 37, {"masked": 0.2}, Sampling(), None),
        ("dtensor_from_parallel_logits_to_logprobs", "dtensor_target", 2, 8, 48, {}, Sampling(top_k=5, temperature=0.7), 3),
    ]
    if quick:
        specs = [specs[1], specs[4], specs[6], specs[8]]
    cases = []
    for op, variant, b, s, v, extra, smp, chunk in specs:
        replicated = variant in ("vocab_replicated", "plain")
        logits_layout = BATCH if replicated else LOGITS

        def run(impl, ctx, x, op=op, variant=variant, smp=smp, chunk=chunk, logits_layout=logits_layout):
            sp = _sampling_params(smp) if smp != Sampling() else None
            logits, ids = x["logits"], x["target"]
            if op == "get_logprobs_from_vocab_parallel_logits":
                if variant == "dtensor_ids":
                    ids = _dtensor(ctx, ids, "target", ids_layout)
                return impl.get_logprobs_from_vocab_parallel_logits(
                    _dtensor(ctx, logits, "logits", logits_layout), ids, seq_index=None, chunk_size=chunk, sampling_params=sp)
            if op == "get_next_token_logprobs_from_logits":
                kw = {}
                if variant == "vocab_parallel_group":
                    kw = dict(vocab_parallel_rank=ctx.rank("tp"), vocab_parallel_group=ctx.group("tp"))
                elif variant == "dtensor":
                    logits = _dtensor(ctx, logits, "logits", logits_layout)
                return impl.get_next_token_logprobs_from_logits(ids, logits, seq_index=None, context_parallel_group=None,
                                                                sampling_params=sp, **kw)
            if variant == "dtensor_target":
                ids = _dtensor(ctx, ids, "target", ids_layout)
            return impl.dtensor_from_parallel_logits_to_logprobs(
                logits, ids, *_vocab_range(ctx), ctx.group("tp"), inference_only=False, seq_index=None,
                chunk_size=chunk, sampling_params=sp)

        even = variant == "vocab_parallel_group"
        supports = _batch_divides(b) if replicated else _next_token_supports(b, s, v, smp, even=even)
        cases.append(Case(
            op=OP + op, case_id=f"{variant}-{_case_id(b, s, v, extra)}-{smp.tag()}" + (f"-chunk{chunk}" if chunk else ""),
            params={"variant": variant, "B": b, "S": s, "V": v, "chunk_size": chunk, **extra, **smp.params()},
            make_inputs=partial(lambda gen, b, s, v, smp, extra: _sampling_inputs(gen, b, s, v, smp, shift=True, **extra),
                                b=b, s=s, v=v, smp=smp, extra=extra),
            reference=_next_token_reference(smp), run=run,
            input_layouts={"logits": logits_layout, "target": BATCH}, output_layouts=(BATCH,), grad_inputs=("logits",),
            comm=NO_COMM if replicated else _contract(
                lambda ctx, s=s, smp=smp, chunk=chunk: next_token_comm(ctx, s, smp, chunk)),
            supports=supports))
    return cases


# ---- communication contracts (property:comm) ----------------------------------------------
#
# Per rank and phase, {"<kind>@<mesh dim>": (calls, bytes)}: exactly what the correct implementation
# (distributed_impl/model_utils.py) does, so one more collective, call or byte fails the case.
# Notation: n = this rank's rows B_local·S (S the full sequence, also for next-token ops, which
# score S positions and drop the last), V_local = this rank's vocab shard, K = ids per position,
# c = number of chunks, e = bytes of the compute dtype (promote(dtype, float32)), e_in = bytes of
# the dtype the logits reach the op in.
# Bytes are what this rank sends (harness.measure.CommCounter): the elements it hands to the
# collective; an all-gather counts its own piece, an all-to-all its whole send buffer. Each
# contract is exactly what the reference implementation needs; its comment gives the lower bound.
# At tp = 1 the ops still call the collectives on a 1-rank group (free, but counted): same formulas.

AR, AG, A2A = "all_reduce@tp", "all_gather@tp", "all_to_all@tp"


def _e(ctx) -> int:
    return torch.promote_types(ctx.dtype, torch.float32).itemsize


def _rows(ctx, name: str = "logits") -> int:
    """n = B_local·S of a [B, S, ...] input."""
    b, s = ctx.local_shape(name)[:2]
    return b * s


def _n_chunks(length: int, chunk: int | None) -> int:
    return 1 if chunk is None else -(-length // chunk)


def _merge(*phases: dict) -> dict:
    out: dict = {}
    for phase in phases:
        for key, (calls, nbytes) in phase.items():
            c0, b0 = out.get(key, (0, 0))
            out[key] = (c0 + calls, b0 + nbytes)
    return out


def _contract(fn):
    """fn(ctx) -> (forward, backward) dicts  ->  a Case.comm."""
    def comm(ctx) -> dict:
        fwd, bwd = fn(ctx)
        return {"forward": fwd, "backward": bwd}
    return comm


NO_COMM = _contract(lambda ctx: ({}, {}))  # full-vocab (non-TP) paths: no collective at all


def softmax_comm(ctx, name: str = "logits") -> dict:
    """Distributed (log-)softmax: one MAX and one SUM all-reduce of a per-row scalar, 2 calls, 2·n·e.
    Lower bound: the full-vocab normaliser needs per-row scalars only, O(n) bytes, never a [n, V] gather."""
    return {AR: (2, 2 * _rows(ctx, name) * _e(ctx))}


def logprob_comm(ctx, s: int, chunk: int | None = None, k: int = 1, grad: bool = True, name: str = "logits"):
    """Vocab-parallel log-probs at K ids per position (DistributedLogprob: chunk None, K 1;
    ChunkedDistributedLogprob / ChunkedDistributedGatherLogprob: chunk over S).
    forward: a log-softmax per chunk (2 calls, 2·n·e in all) + one SUM of [picked, owner count]
             (2·n·K·e): 2c + 1 calls, (2 + 2K)·n·e;
    backward: unchunked none (the saved softmax is local); chunked recomputes each chunk's softmax:
             2c calls, 2·n·e.
    Lower bound: per-row scalars and the K picked values only: O(n·K) bytes, never a [n, V] gather;
    no backward communication (the chunked backward's recompute trades 2·n·e for O(chunk·V_local) memory)."""
    n, e = _rows(ctx, name), _e(ctx)
    c = _n_chunks(s, chunk)
    fwd = {AR: (2 * c + 1, (2 + 2 * k) * n * e)}
    bwd = {AR: (2 * c, 2 * n * e)} if grad and chunk is not None else {}
    return fwd, bwd


def cross_entropy_comm(ctx):
    """DistributedCrossEntropy: softmax(target) and log_softmax(student) (2 calls each) + one SUM of the
    per-row partial H(p, q): 5 calls, 5·n·e; backward none ((q - p)·g is local).
    Lower bound: per-row scalars only, O(n), never a [n, V] gather."""
    return {AR: (5, 5 * _rows(ctx, "student_logits") * _e(ctx))}, {}


def entropy_comm(ctx, s: int, chunk: int, name: str = "logits"):
    """ChunkedDistributedEntropy: a log-softmax per chunk (2 calls, 2·n·e in all) + one SUM of the
    per-row partial Σ p log p (n·e): 2c + 1 calls, 3·n·e; backward recomputes the softmax per chunk:
    2c calls, 2·n·e. Lower bound: per-row scalars only, O(n), never a [n, V] gather."""
    n, e = _rows(ctx, name), _e(ctx)
    c = _n_chunks(s, chunk)
    return {AR: (2 * c + 1, 3 * n * e)}, {AR: (2 * c, 2 * n * e)}


def gather_logits_comm(ctx, k: int, name: str = "logits"):
    """gather_logits_at_global_indices over TP: each id's owner contributes its logit, one SUM of
    [n, K]: 1 call, n·K·e; backward none. Lower bound: the K picked values, O(n·K)."""
    return {AR: (1, _rows(ctx, name) * k * _e(ctx))}, {}


def topk_comm(ctx, s: int, k: int, chunk: int | None):
    """distributed_vocab_topk: per chunk one all-gather of this rank's k candidate values (e) and one
    of their int64 ids: 2c calls, n·k·(e + 8) bytes sent. No backward.
    Lower bound: O(n·k) candidates per rank, never the [n, V_local] shard."""
    return {AG: (2 * _n_chunks(s, chunk), _rows(ctx) * k * (_e(ctx) + 8))}, {}


def sampling_comm(ctx, chunk: int | None, e_in: int, grad: bool = True):
    """Top-k/top-p log-probs (DistributedLogprobWithSampling, the chunked one, and the filtering paths of
    from_parallel_logits_to_logprobs): the [n, V_local] rows move to [n/TP, V] with an all-to-all.
    forward: one all-gather of (B, S, V_local) for the layout check (3·8 B) and one of this rank's
             n/TP per-row log-probs (n/TP·e): 2 calls; c all-to-alls of the rows in the logits' dtype:
             n·V_local·e_in in all;
    backward: unchunked one all-to-all of the gradient back, n·V_local·e_in; chunked recomputes each
             chunk's all-to-all then sends its gradient: 2c calls, 2·n·V_local·e_in.
    Chunk rows: chunk·B_local rounded up to a multiple of TP. Lower bound for exact filtering in this
    layout: every rank's shard crosses once per direction, Θ(n·V_local) bytes (vs an all-gather of the
    full vocab to every rank: TP× more); the chunked backward's recompute doubles it to save memory."""
    n, tp = _rows(ctx), ctx.size("tp")
    b_local = ctx.local_shape("logits")[0]
    v_local = ctx.local_shape("logits")[-1]
    rows_per_chunk = n if chunk is None else min(n, -(-chunk * b_local // tp) * tp)
    c = -(-n // rows_per_chunk)
    shard = n * v_local * e_in
    fwd = {AG: (2, 3 * 8 + n // tp * _e(ctx)), A2A: (c, shard)}
    if not grad:
        return fwd, {}
    return fwd, ({A2A: (1, shard)} if chunk is None else {A2A: (2 * c, 2 * shard)})


def hidden_comm(ctx, s: int, chunk: int | None):
    """Hidden states -> log-probs (ChunkedDistributedHiddenStatesToLogprobs, from_parallel_hidden_states_to_logprobs):
    forward: all-gather of the sequence shards [S/TP, B, H] (this rank sends its shard, e_in)
             + vocab-parallel log-probs of the projected chunks: 2c + 1 all-reduces, 4·B·S·e;
    backward: the same all-gather again (the forward keeps only the local shard), the softmax per chunk
             (2c calls, 2·B·S·e) and the hidden-state gradient reduce-scattered as one all-to-all of the
             [S, B, H] partial sums (compute dtype); the weight gradient is local.
    Plus the suite's own DDP stand-in (harness.case.GradSum): one all_reduce@dp of the [V_local, H]
    weight gradient (compute dtype) in the backward when dp > 1.
    Lower bound: sequence-parallel input needs the [S, B, H] gather (O(S·B·H), independent of V) and a
    reduce-scatter of its gradient; the vocab side per-row scalars only, never [B, S, V] logits."""
    s_local, b, h = ctx.local_shape("hidden")
    v_local = ctx.local_shape("weight")[0]
    e, e_in = _e(ctx), ctx.dtype.itemsize
    c = _n_chunks(s, chunk)
    shard = s_local * b * h * e_in
    fwd = {AG: (1, shard), AR: (2 * c + 1, 4 * b * s * e)}
    bwd = {AG: (1, shard), AR: (2 * c, 2 * b * s * e), A2A: (1, s * b * h * e)}
    if ctx.size("dp") > 1:
        bwd["all_reduce@dp"] = (1, v_local * h * e)
    return fwd, bwd


def all_to_all_comm(ctx):
    """all_to_all_vp2sq / sq2vp: one all-gather of the two sizes for the equal-shards check (2·8 B)
    and one all-to-all of this rank's shard, e_in; no backward here (no gradient checked).
    Lower bound: the layout change itself, this rank's shard once."""
    numel = 1
    for d in ctx.local_shape("logits"):
        numel *= d
    return {AG: (1, 2 * 8), A2A: (1, numel * ctx.dtype.itemsize)}, {}


def next_token_comm(ctx, s: int, smp: "Sampling", chunk: int | None, grad: bool = True):
    """from_parallel_logits_to_logprobs (and the front ends over it): the plain, chunked or sampling path.
    Unchunked with a temperature, the logits are upcast (and scaled) before the op: e_in = e."""
    if smp.filtering:
        e_in = _e(ctx) if chunk is None and smp.temperature != 1.0 else ctx.dtype.itemsize
        return sampling_comm(ctx, chunk, e_in, grad)
    return logprob_comm(ctx, s, chunk, grad=grad)


def distillation_comm(ctx, s: int, k: int, zero: bool, entropy: bool):
    """get_distillation_topk_logprobs_from_logits on the TP (group or DTensor) path, chunk = min(S, 1024):
    zero_outside_topk: ChunkedDistributedGatherLogprob at the K ids (logprob_comm with K), else
    gather_logits_at_global_indices (one SUM of [n, K]); calculate_entropy adds ChunkedDistributedEntropy.
    The teacher side is local. DTensor student logits add nothing (to_local / from_local are local)."""
    chunk = max(1, min(s, 1024))
    fwd, bwd = logprob_comm(ctx, s, chunk, k=k, name="student_logits") if zero else \
        gather_logits_comm(ctx, k, name="student_logits")
    if entropy:
        f2, b2 = entropy_comm(ctx, s, chunk, name="student_logits")
        fwd, bwd = _merge(fwd, f2), _merge(bwd, b2)
    return fwd, bwd


def cases(quick: bool = False) -> list[Case]:
    shapes = QUICK_SHAPES if quick else SHAPES
    phase1 = softmax_cases(shapes) + logprob_cases(shapes, quick) + cross_entropy_cases(shapes) + all_to_all_cases(quick)
    phase2 = (sampling_cases(quick) + gather_logprob_cases(quick) + gather_logits_cases(quick) + topk_cases(quick)
              + distillation_cases(quick) + entropy_cases(quick) + hidden_states_cases(quick)
              + from_parallel_sampling_cases(quick) + front_end_cases(quick))
    return phase1 + phase2


# ---- benchmarks (`shardcheck run --bench`) -------------------------------------------------
#
# Realistic CPU sizes, float32 by default (the CLI's bench dtype): B·S up to 4096 tokens, V_local up
# to 32k. Each sweep names the parameter its plot varies (params["sweep"]); every sweep but "tp" runs
# at dp = cp = tp = 1 only, where the worker also times the single-device reference on the same
# inputs; the "tp" sweep runs the same case ids at tp 1, 2, 4 with the total V fixed (V_local = V/TP).
# The targets: ChunkedDistributedLogprob (chunk S/16) vs DistributedLogprob at S = 4096,
# V_local = 8192, B = 1, TP = 1 (peak memory fwd and fwd+bwd), and the hidden-states op vs its
# reference, which materialises the full [B, S, V] logits. Sizes keep the whole `shardcheck run
# --bench` (both suites) within ~5 minutes on a 2-core machine: each case runs ~15 fwd+bwd steps,
# plus ~13 reference steps at size 1.

BENCH_TOP_K, BENCH_TOP_P = 50, 0.9


def _bench_supports(sweep: str):
    if sweep == "tp":
        return lambda t: t.dp == 1 and t.cp == 1
    return lambda t: t.size == 1


def _bench_logits_inputs(b: int, s: int, v: int, two: bool = False):
    """Logits [B, S, V] (N(0, 3²)) and in-range targets; `two`: student and target logits instead."""
    def make(gen):
        if two:
            return {"student_logits": make_logits(gen, (b, s, v)), "target_logits": make_logits(gen, (b, s, v))}
        return {"logits": make_logits(gen, (b, s, v)), "target": torch.randint(0, v, (b, s), generator=gen)}
    return make


def _bench_hidden_inputs(s: int, b: int, h: int, v: int):
    """hidden [S, B, H] ~ N(0, 1), weight [V, H] ~ N(0, 9/H): logits ~ N(0, 3²), as the logits benches."""
    def make(gen):
        return {"hidden": torch.randn((s, b, h), generator=gen, dtype=torch.float64),
                "weight": torch.randn((v, h), generator=gen, dtype=torch.float64) * (3.0 / h ** 0.5),
                "target": torch.randint(0, v, (b, s), generator=gen)}
    return make


def bench_case(op: str, sweep: str, b: int, s: int, v: int, chunk: int | None = None, h: int | None = None) -> Case:
    """One benchmark case of `op` (B, S, total V; chunk_size; H for the hidden-states op)."""
    params = {"B": b, "S": s, "V": v, "tokens": b * s, "chunk_size": chunk, "sweep": sweep}
    case_id = f"bench-{sweep}-b{b}s{s}v{v}" + (f"-h{h}" if h else "") + (f"-chunk{chunk}" if chunk else "")
    logits_io = dict(make_inputs=_bench_logits_inputs(b, s, v), input_layouts={"logits": LOGITS, "target": BATCH},
                     grad_inputs=("logits",))
    smp = Sampling(top_k=BENCH_TOP_K, top_p=BENCH_TOP_P)
    if op == "DistributedLogprob":
        spec = dict(run=lambda impl, ctx, x: impl.DistributedLogprob.apply(
                        x["logits"], x["target"], *_vocab_range(ctx), ctx.group("tp")),
                    reference=lambda x: ref.logprob(x["logits"], x["target"]),
                    comm=_contract(lambda ctx: logprob_comm(ctx, s)), **logits_io)
    elif op == "ChunkedDistributedLogprob":
        spec = dict(run=lambda impl, ctx, x: impl.ChunkedDistributedLogprob.apply(
                        x["logits"], x["target"], *_vocab_range(ctx), chunk, ctx.group("tp")),
                    reference=lambda x: ref.logprob(x["logits"], x["target"]),
                    comm=_contract(lambda ctx: logprob_comm(ctx, s, chunk)), **logits_io)
    elif op == "from_parallel_logits_to_logprobs":
        spec = dict(run=lambda impl, ctx, x: impl.from_parallel_logits_to_logprobs(
                        x["logits"], x["target"], *_vocab_range(ctx), ctx.group("tp"), chunk_size=chunk),
                    reference=lambda x: ref.next_token_logprobs(x["logits"], x["target"]),
                    comm=_contract(lambda ctx: logprob_comm(ctx, s, chunk)), **logits_io)
    elif op == "DistributedCrossEntropy":
        spec = dict(make_inputs=_bench_logits_inputs(b, s, v, two=True),
                    run=lambda impl, ctx, x: impl.DistributedCrossEntropy.apply(
                        x["student_logits"], x["target_logits"], ctx.group("tp")),
                    reference=lambda x: ref.cross_entropy(x["student_logits"], x["target_logits"]),
                    input_layouts={"student_logits": LOGITS, "target_logits": LOGITS}, grad_inputs=("student_logits",),
                    comm=_contract(cross_entropy_comm))
    elif op == "DistributedLogprobWithSampling":
        params.update(smp.params())
        spec = dict(run=lambda impl, ctx, x: impl.DistributedLogprobWithSampling.apply(
                        x["logits"], x["target"], ctx.group("tp"), smp.top_k, smp.top_p),
                    reference=lambda x: ref.sampling_logprob(x["logits"], x["target"], smp.top_k, smp.top_p),
                    comm=_contract(lambda ctx: sampling_comm(ctx, None, ctx.dtype.itemsize)), **logits_io)
    elif op == "ChunkedDistributedEntropy":
        spec = dict(make_inputs=_bench_logits_inputs(b, s, v), input_layouts={"logits": LOGITS}, grad_inputs=("logits",),
                    run=lambda impl, ctx, x: impl.ChunkedDistributedEntropy.apply(x["logits"], chunk, ctx.group("tp")),
                    reference=lambda x: ref.entropy(x["logits"]),
                    comm=_contract(lambda ctx: entropy_comm(ctx, s, chunk)))
    elif op == "from_parallel_hidden_states_to_logprobs":
        params["H"] = h
        spec = dict(make_inputs=_bench_hidden_inputs(s, b, h, v),
                    input_layouts={"hidden": SEQ_HIDDEN, "weight": WEIGHT, "target": BATCH}, grad_inputs=("hidden", "weight"),
                    run=lambda impl, ctx, x: impl.from_parallel_hidden_states_to_logprobs(
                        x["hidden"], None, x["weight"], False, x["target"], *ctx.local_range("weight", 0), ctx.group("tp"),
                        chunk_size=chunk),
                    reference=lambda x: ref.hidden_states_to_logprobs(x["hidden"], x["weight"], x["target"]),
                    comm=_contract(lambda ctx: hidden_comm(ctx, s, chunk)))
    else:
        raise ValueError(f"no benchmark for {op}")
    return Case(op=OP + op, case_id=case_id, params=params, output_layouts=(BATCH,),
                supports=_bench_supports(sweep), **spec)


LOGPROB_BENCH_OPS = ("DistributedLogprob", "ChunkedDistributedLogprob")


def bench_cases(quick: bool = False) -> list[Case]:
    if quick:  # tiny: a 2-point S sweep of the two logprob ops and one op over tp, a few seconds
        return ([bench_case(op, "S", 1, s, 1024, s // 16 if op.startswith("Chunked") else None)
                 for s in (64, 256) for op in LOGPROB_BENCH_OPS]
                + [bench_case("DistributedLogprob", "tp", 1, 128, 1024)])
    v = 8192
    cases = []
    # S: chunked (S/16) vs unchunked log-probs, B = 1, V_local = 8192; S = 4096 is the target pair.
    for s in (1024, 2048, 4096):
        cases += [bench_case("DistributedLogprob", "S", 1, s, v),
                  bench_case("ChunkedDistributedLogprob", "S", 1, s, v, s // 16)]
    # The hidden-states op (chunk S/16) vs its reference (full [B, S, V] logits), H = 256.
    for s in (1024, 4096):
        cases.append(bench_case("from_parallel_hidden_states_to_logprobs", "S", 1, s, v, s // 16, h=256))
    # V: 512 tokens, V_local from 8k to 32k.
    for vv in (8192, 32768):
        cases += [bench_case("DistributedLogprob", "V", 1, 512, vv), bench_case("ChunkedDistributedLogprob", "V", 1, 512, vv, 32)]
    # chunk_size: ChunkedDistributedLogprob at S = 1024 (1024: a single chunk).
    cases += [bench_case("ChunkedDistributedLogprob", "chunk_size", 1, 1024, v, c) for c in (64, 256, 1024)]
    # tp: 512 tokens, total V = 8192 (V_local 8192, 4096, 2048), chunk S/16 where there is one.
    s = 512
    cases += [bench_case("DistributedLogprob", "tp", 1, s, v),
              bench_case("ChunkedDistributedLogprob", "tp", 1, s, v, s // 16),
              bench_case("from_parallel_logits_to_logprobs", "tp", 1, s, v),
              bench_case("DistributedCrossEntropy", "tp", 1, s, v),
              bench_case("ChunkedDistributedEntropy", "tp", 1, s, v, s // 16),
              bench_case("DistributedLogprobWithSampling", "tp", 1, s, v),
              bench_case("from_parallel_hidden_states_to_logprobs", "tp", 1, s, v, s // 16, h=256)]
    return cases
