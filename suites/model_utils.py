"""Suite for nemo_rl.distributed.model_utils: vocab-parallel (TP) log-probs and friends.

Layouts: logits [B, S, V] are sharded on the batch over DP and on the vocab over TP
(contiguous, torch.chunk sizes, so V not divisible by TP gives uneven shards); targets are
sharded over DP and replicated over TP; TP-all-reduced outputs are replicated over TP.
"""

from __future__ import annotations

from functools import partial

import torch
from torch.distributed.tensor import Shard

from harness.case import Case, Layout
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
                input_layouts={"logits": LOGITS}, output_layouts=(LOGITS,), supports=_batch_divides(b)))
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
            **common))
        for chunk in chunk_sizes:
            cases.append(Case(
                op=OP + "ChunkedDistributedLogprob", case_id=f"{_case_id(b, s, v, extra)}-chunk{chunk}",
                params={**params, "chunk_size": chunk}, make_inputs=inputs,
                reference=lambda x: ref.logprob(x["logits"], x["target"]),
                run=lambda impl, ctx, x, chunk=chunk: impl.ChunkedDistributedLogprob.apply(
                    x["logits"], x["target"], *_vocab_range(ctx), chunk, ctx.group("tp")),
                **common))
        for chunk in [None] + chunk_sizes[:1]:
            cases.append(Case(
                op=OP + "from_parallel_logits_to_logprobs", case_id=f"{_case_id(b, s, v, extra)}-chunk{chunk}",
                params={**params, "chunk_size": chunk}, make_inputs=partial(inputs, shift=True),
                reference=lambda x: ref.next_token_logprobs(x["logits"], x["target"]),
                run=lambda impl, ctx, x, chunk=chunk: impl.from_parallel_logits_to_logprobs(
                    x["logits"], x["target"], *_vocab_range(ctx), ctx.group("tp"), chunk_size=chunk),
                **common))
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
            grad_inputs=("student_logits",), supports=_batch_divides(b)))
    cases.append(Case(
        op=OP + "DistributedCrossEntropy", case_id="shape-mismatch", params={"student": [2, 4, 16], "target": [2, 3, 16]},
        make_inputs=lambda gen: {"student_logits": make_logits(gen, (2, 4, 16)), "target_logits": make_logits(gen, (2, 3, 16))},
        reference=lambda x: None,
        run=lambda impl, ctx, x: impl.DistributedCrossEntropy.apply(x["student_logits"], x["target_logits"], ctx.group("tp")),
        input_layouts={"student_logits": LOGITS, "target_logits": LOGITS}, raises=ValueError, dtypes=("float64",),
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
                input_layouts={"logits": layouts[0]}, output_layouts=(layouts[1],),
                supports=lambda t, rows=rows, v=v: (rows // t.dp) % t.tp == 0 and v % t.tp == 0))
    # Not divisible / not 2-D: ValueError on every rank.
    # vp2sq splits the rows over TP, sq2vp the vocab: each must refuse a size TP does not divide.
    for op, (rows, v) in (("all_to_all_vp2sq", (6, 8)), ("all_to_all_sq2vp", (8, 6))):
        cases.append(Case(
            op=OP + op, case_id=f"bs{rows}v{v}-not-divisible", params={"BS": rows, "V": v},
            make_inputs=lambda gen, rows=rows, v=v: {"logits": make_logits(gen, (rows, v))}, reference=lambda x: None,
            run=lambda impl, ctx, x, op=op: getattr(impl, op)(x["logits"], ctx.group("tp")),
            raises=ValueError, dtypes=("float64",), supports=lambda t: t.tp == 4 and t.dp == 1))
        cases.append(Case(
            op=OP + op, case_id="not-2d", params={"shape": [2, 4, 8]},
            make_inputs=lambda gen: {"logits": make_logits(gen, (2, 4, 8))}, reference=lambda x: None,
            run=lambda impl, ctx, x, op=op: getattr(impl, op)(x["logits"], ctx.group("tp")),
            raises=ValueError, dtypes=("float64",), supports=lambda t: t.dp == 1))
    return cases


def cases(quick: bool = False) -> list[Case]:
    shapes = QUICK_SHAPES if quick else SHAPES
    return softmax_cases(shapes) + logprob_cases(shapes, quick) + cross_entropy_cases(shapes) + all_to_all_cases(quick)
