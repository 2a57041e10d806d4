"""model_utils benchmarks (`shardcheck run --bench`): time, memory and collectives of the TP ops at realistic sizes."""

from __future__ import annotations

import torch

from shardcheck import Case, MemoryModel
from shardcheck.reference import model_utils as ref
from shardcheck.suites._model_utils_comm import (
    contract,
    cross_entropy_comm,
    entropy_comm,
    hidden_comm,
    logprob_comm,
    sampling_comm,
)
from shardcheck.suites._model_utils_inputs import BATCH, LOGITS, SEQ_HIDDEN, WEIGHT, Sampling, make_logits, vocab_range

OP = "model_utils."


# Realistic CPU sizes, float32 by default (the CLI's bench dtype): B·S up to 4096 tokens, V_local up
# to 32k. Each sweep names the parameter its plot varies (params["sweep"]); every sweep but "tp" runs
# at dp = cp = tp = 1 only, where the worker also times the single-device reference on the same
# inputs; the "tp" sweep runs the same case ids at tp 1, 2, 4 with the total V fixed (V_local = V/TP).
# The targets (docs/performance.md, Measurements): ChunkedDistributedLogprob (chunk S/16) vs DistributedLogprob
# at S = 4096, V_local = 8192, B = 1, TP = 1 (peak memory fwd and fwd+bwd), and the hidden-states op vs its
# reference, which materialises the full [B, S, V] logits. Sizes keep the whole `shardcheck run
# --bench` (both suites) within ~5 minutes on a 2-core machine: each case runs ~15 fwd+bwd steps,
# plus ~13 reference steps at size 1.

BENCH_TOP_K, BENCH_TOP_P = 50, 0.9


def _supports(sweep: str):
    if sweep == "tp":
        return lambda t: t.dp == 1 and t.cp == 1
    return lambda t: t.size == 1


def _logits_inputs(b: int, s: int, v: int, two: bool = False):
    """Logits [B, S, V] (N(0, 3²)) and in-range targets; `two`: student and target logits instead."""

    def make(gen):
        if two:
            return {"student_logits": make_logits(gen, (b, s, v)), "target_logits": make_logits(gen, (b, s, v))}
        return {"logits": make_logits(gen, (b, s, v)), "target": torch.randint(0, v, (b, s), generator=gen)}

    return make


def _hidden_inputs(s: int, b: int, h: int, v: int):
    """hidden [S, B, H] ~ N(0, 1), weight [V, H] ~ N(0, 9/H): logits ~ N(0, 3²), as the logits benches."""

    def make(gen):
        return {
            "hidden": torch.randn((s, b, h), generator=gen, dtype=torch.float64),
            "weight": torch.randn((v, h), generator=gen, dtype=torch.float64) * (3.0 / h**0.5),
            "target": torch.randint(0, v, (b, s), generator=gen),
        }

    return make


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def logprob_memory(chunk: int | None):
    """The per-rank peak of (Chunked)DistributedLogprob's forward and backward, from the shapes (distributed_impl/
    model_utils.py).  N = B·S tokens, V_l the local vocab, c the compute dtype's size (float32 at least), i the
    logits' own; the inputs exist before the step and do not count, the [N] vectors are left out (< 1 %).

    - DistributedLogprob: the forward holds x − max and its exp at once (2·N·V_l·c), saves the softmax (N·V_l·c);
      the backward builds the gradient beside it (2·N·V_l·c), cast to the logits' dtype (+ N·V_l·i) below float32.
    - ChunkedDistributedLogprob: saves only the logits (an input); the backward's gradient of the logits (N·V_l·i)
      is filled chunk by chunk: a chunk's softmax and its gradient (2·B·chunk·V_l·c), and one more chunk, the
      previous one's, which the loop's names hold until the new one is bound (3 chunks in all; 2 for a single chunk)."""

    def model(ctx) -> MemoryModel:
        b, s, v_local = ctx.local_shape("logits")
        c = torch.promote_types(ctx.dtype, torch.float32).itemsize
        i = ctx.dtype.itemsize
        full = b * s * v_local
        if chunk is None:
            cast = full * i if i != c else 0
            return MemoryModel(
                peak_bytes=2 * full * c + cast,
                saved_bytes=full * c,
                terms=f"softmax + its gradient 2 × {_mib(full * c)}" + (f" + cast {_mib(cast)}" if cast else ""),
            )
        work = b * min(chunk, s) * v_local * c
        chunks = 3 if s > chunk else 2  # one chunk only: no previous one
        return MemoryModel(
            peak_bytes=full * i + chunks * work,
            saved_bytes=0,
            terms=f"logits' gradient {_mib(full * i)} + chunk workspace {chunks} × {_mib(work)}",
        )

    return model


def bench_case(op: str, sweep: str, b: int, s: int, v: int, chunk: int | None = None, h: int | None = None) -> Case:
    """One benchmark case of `op` (B, S, total V; chunk_size; H for the hidden-states op)."""
    params = {"B": b, "S": s, "V": v, "tokens": b * s, "chunk_size": chunk, "sweep": sweep}
    case_id = f"bench-{sweep}-b{b}s{s}v{v}" + (f"-h{h}" if h else "") + (f"-chunk{chunk}" if chunk else "")
    logits_io = dict(
        make_inputs=_logits_inputs(b, s, v), input_layouts={"logits": LOGITS, "target": BATCH}, grad_inputs=("logits",)
    )
    smp = Sampling(top_k=BENCH_TOP_K, top_p=BENCH_TOP_P)
    if op == "DistributedLogprob":
        spec = dict(
            run=lambda impl, ctx, x: impl.DistributedLogprob.apply(
                x["logits"], x["target"], *vocab_range(ctx), ctx.group("tp")
            ),
            reference=lambda x: ref.logprob(x["logits"], x["target"]),
            comm=contract(lambda ctx: logprob_comm(ctx, s)),
            memory=logprob_memory(None),
            **logits_io,
        )
    elif op == "ChunkedDistributedLogprob":
        spec = dict(
            run=lambda impl, ctx, x: impl.ChunkedDistributedLogprob.apply(
                x["logits"], x["target"], *vocab_range(ctx), chunk, ctx.group("tp")
            ),
            reference=lambda x: ref.logprob(x["logits"], x["target"]),
            comm=contract(lambda ctx: logprob_comm(ctx, s, chunk)),
            memory=logprob_memory(chunk),
            **logits_io,
        )
    elif op == "from_parallel_logits_to_logprobs":
        spec = dict(
            run=lambda impl, ctx, x: impl.from_parallel_logits_to_logprobs(
                x["logits"], x["target"], *vocab_range(ctx), ctx.group("tp"), chunk_size=chunk
            ),
            reference=lambda x: ref.next_token_logprobs(x["logits"], x["target"]),
            comm=contract(lambda ctx: logprob_comm(ctx, s, chunk)),
            **logits_io,
        )
    elif op == "DistributedCrossEntropy":
        spec = dict(
            make_inputs=_logits_inputs(b, s, v, two=True),
            run=lambda impl, ctx, x: impl.DistributedCrossEntropy.apply(
                x["student_logits"], x["target_logits"], ctx.group("tp")
            ),
            reference=lambda x: ref.cross_entropy(x["student_logits"], x["target_logits"]),
            input_layouts={"student_logits": LOGITS, "target_logits": LOGITS},
            grad_inputs=("student_logits",),
            comm=contract(cross_entropy_comm),
        )
    elif op == "DistributedLogprobWithSampling":
        params.update(smp.params())
        spec = dict(
            run=lambda impl, ctx, x: impl.DistributedLogprobWithSampling.apply(
                x["logits"], x["target"], ctx.group("tp"), smp.top_k, smp.top_p
            ),
            reference=lambda x: ref.sampling_logprob(x["logits"], x["target"], smp.top_k, smp.top_p),
            comm=contract(lambda ctx: sampling_comm(ctx, None, ctx.dtype.itemsize)),
            **logits_io,
        )
    elif op == "ChunkedDistributedEntropy":
        spec = dict(
            make_inputs=_logits_inputs(b, s, v),
            input_layouts={"logits": LOGITS},
            grad_inputs=("logits",),
            run=lambda impl, ctx, x: impl.ChunkedDistributedEntropy.apply(x["logits"], chunk, ctx.group("tp")),
            reference=lambda x: ref.entropy(x["logits"]),
            comm=contract(lambda ctx: entropy_comm(ctx, s, chunk)),
        )
    elif op == "from_parallel_hidden_states_to_logprobs":
        params["H"] = h
        spec = dict(
            make_inputs=_hidden_inputs(s, b, h, v),
            input_layouts={"hidden": SEQ_HIDDEN, "weight": WEIGHT, "target": BATCH},
            grad_inputs=("hidden", "weight"),
            run=lambda impl, ctx, x: impl.from_parallel_hidden_states_to_logprobs(
                x["hidden"],
                None,
                x["weight"],
                False,
                x["target"],
                *ctx.local_range("weight", 0),
                ctx.group("tp"),
                chunk_size=chunk,
            ),
            reference=lambda x: ref.hidden_states_to_logprobs(x["hidden"], x["weight"], x["target"]),
            comm=contract(lambda ctx: hidden_comm(ctx, s, chunk)),
        )
    else:
        raise ValueError(f"no benchmark for {op}")
    return Case(op=OP + op, case_id=case_id, params=params, output_layouts=(BATCH,), supports=_supports(sweep), **spec)


LOGPROB_BENCH_OPS = ("DistributedLogprob", "ChunkedDistributedLogprob")


def bench_cases(quick: bool = False) -> list[Case]:
    if quick:  # tiny: a 2-point S sweep of the two logprob ops and one op over tp, a few seconds
        return [
            bench_case(op, "S", 1, s, 1024, s // 16 if op.startswith("Chunked") else None)
            for s in (64, 256)
            for op in LOGPROB_BENCH_OPS
        ] + [bench_case("DistributedLogprob", "tp", 1, 128, 1024)]
    v = 8192
    cases = []
    # S: chunked (S/16) vs unchunked log-probs, B = 1, V_local = 8192; S = 4096 is the target pair.
    for s in (1024, 2048, 4096):
        cases += [
            bench_case("DistributedLogprob", "S", 1, s, v),
            bench_case("ChunkedDistributedLogprob", "S", 1, s, v, s // 16),
        ]
    # The hidden-states op (chunk S/16) vs its reference (full [B, S, V] logits), H = 256.
    for s in (1024, 4096):
        cases.append(bench_case("from_parallel_hidden_states_to_logprobs", "S", 1, s, v, s // 16, h=256))
    # V: 512 tokens, V_local from 8k to 32k.
    for vv in (8192, 32768):
        cases += [
            bench_case("DistributedLogprob", "V", 1, 512, vv),
            bench_case("ChunkedDistributedLogprob", "V", 1, 512, vv, 32),
        ]
    # chunk_size: ChunkedDistributedLogprob at S = 1024 (1024: a single chunk).
    cases += [bench_case("ChunkedDistributedLogprob", "chunk_size", 1, 1024, v, c) for c in (64, 256, 1024)]
    # tp: 512 tokens, total V = 8192 (V_local 8192, 4096, 2048), chunk S/16 where there is one.
    s = 512
    cases += [
        bench_case("DistributedLogprob", "tp", 1, s, v),
        bench_case("ChunkedDistributedLogprob", "tp", 1, s, v, s // 16),
        bench_case("from_parallel_logits_to_logprobs", "tp", 1, s, v),
        bench_case("DistributedCrossEntropy", "tp", 1, s, v),
        bench_case("ChunkedDistributedEntropy", "tp", 1, s, v, s // 16),
        bench_case("DistributedLogprobWithSampling", "tp", 1, s, v),
        bench_case("from_parallel_hidden_states_to_logprobs", "tp", 1, s, v, s // 16, h=256),
    ]
    return cases
