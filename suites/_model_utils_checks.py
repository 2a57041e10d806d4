"""model_utils suites: properties and output checks beyond the harness's comparison with the golden.

A property is `(ctx, full, local, outs) -> [Property]` (Case.properties); an output check replaces the numeric
forward check of one output: `(got, expected, full, local, ctx) -> (passed, message)` (Case.output_checks).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from shardcheck import Case, OutsideSeed, PrecisionOnly, Property, Rule, cite, ours, seed
from shardcheck.reference import model_utils as ref
from shardcheck.suites._model_utils_inputs import BATCH, Sampling, tie_straddles


def combine(*fns):
    """One Case.properties running each of `fns` (None skipped); None when there is none."""
    fns = [f for f in fns if f is not None]
    if not fns:
        return None
    return lambda ctx, full, local, outs: [p for f in fns for p in f(ctx, full, local, outs)]


def finite_scale(t: torch.Tensor) -> float:
    """The largest finite magnitude of `t` (0 when none is finite)."""
    t = t[torch.isfinite(t)]
    return float(t.abs().max()) if t.numel() else 0.0


def close(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float) -> Property:
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
    tol = rtol * max(1.0, finite_scale(w))
    return Property(name, err <= tol, err, f"max |chunked - unchunked| {err:.3g} (tolerance {tol:.3g})")


def chunked_equals_unchunked(unchunked, eps_of=None, factor: float = 16.0):
    """property chunked_equals_unchunked: the op's first output equals the unchunked op's on the same
    rank's inputs.  `unchunked(impl, ctx, detached_inputs)`; tolerance factor * eps of the output
    dtype (or of `eps_of(ctx)`)."""

    def prop(ctx, full, local, outs):
        inputs = {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in local.items()}
        with torch.no_grad():
            want = unchunked(ctx.impl, ctx, inputs)
        eps = torch.finfo(eps_of(ctx) if eps_of else outs[0].dtype).eps
        return [close("chunked_equals_unchunked", outs[0], want, factor * eps)]

    return prop


def survivors_sum_to_1(call, v: int):
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
        return [
            Property(
                "survivors_sum_to_1",
                err <= tol,
                err,
                f"max |sum_v p_v - 1| {err:.3g} over survivors (tolerance {tol:.3g})",
            )
        ]

    return prop


def entropy_nonpositive(ctx, full, local, outs):
    h = outs[0].detach()
    bad = ~(h <= 0)  # NaN counts as bad
    worst = float(h[torch.isfinite(h)].max()) if torch.isfinite(h).any() else float("nan")
    msg = f"max H_all {worst:.3g}" + (
        f"; {int(bad.sum())} position(s) > 0 or NaN, first at {tuple(int(i) for i in bad.nonzero()[0])}"
        if bad.any()
        else ""
    )
    return [Property("entropy_nonpositive", not bool(bad.any()), worst, msg)]


def any_tied_survivor(smp: Sampling):
    """Forward check of a top-p case with tied logits at the boundary: the golden's values, except where
    the target is in a tie group that top-p keeps in part: there it may have survived (its log-prob over
    the kept set, the same whichever tied ids are kept) or not (-inf)."""

    def check(got, expected, full, local, ctx):
        x = BATCH.local(full["logits"], ctx.mesh).double() / smp.temperature
        target = BATCH.local(full["target"], ctx.mesh).long()
        V = x.shape[-1]
        valid = (target >= 0) & (target < V)
        t = target.clamp(0, V - 1)[..., None]
        open_choice = valid & tie_straddles(x, smp.top_k, smp.top_p).gather(-1, t).squeeze(-1)
        if_kept = x.gather(-1, t).squeeze(-1) - torch.logsumexp(ref.filter_logits(x, smp.top_k, smp.top_p), -1)
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
            return False, f"got {getattr(got, 'shape', type(got).__name__)}, expected shape {tuple(expected.shape)}"
        g, e = got.detach().double().cpu(), expected.double()
        tol = 64 * torch.finfo(got.dtype).eps * max(1.0, finite_scale(e))

        def near(a, b):
            return (a == b) | ((a - b).abs() <= tol)

        ok = near(g, e) | (open_choice & ((g == float("-inf")) | near(g, if_kept)))
        if not ok.all():
            i = tuple(int(j) for j in (~ok).nonzero()[0])
            return False, (
                f"{int((~ok).sum())} position(s) wrong, first at local {i}: expected {float(e[i])}"
                + (f" or {float(if_kept[i])} or -inf (tied at the top-p boundary)" if open_choice[i] else "")
                + f", got {float(g[i])}"
            )
        return True, f"{int(open_choice.sum())} target(s) tied at the top-p boundary; any tied survivor accepted"

    return check


LOWER_DTYPES = {torch.float64: torch.float32, torch.float32: torch.bfloat16}  # asked for -> the next lower


def topk_values_exact(got, expected, full, local, ctx):
    """Values: exactly torch.topk of the full logits, in the compute dtype.  The seed states no dtype for them: values
    exactly torch.topk's rounded to a lower dtype are a precision warning (ours), a wrong value a failure."""
    want_dtype = torch.promote_types(ctx.dtype, torch.float32)
    if isinstance(got, torch.Tensor):
        got = got.detach().cpu()  # the expected values are the golden's, on the CPU (got: on the run's device)
    lower = isinstance(got, torch.Tensor) and got.dtype == LOWER_DTYPES.get(want_dtype)
    if lower and got.shape == expected.shape and torch.equal(got, expected.to(got.dtype)):
        return PrecisionOnly(got.dtype, f"values torch.topk's rounded to {got.dtype} exactly, expected {want_dtype}")
    if not isinstance(got, torch.Tensor) or got.dtype != want_dtype or got.shape != expected.shape:
        what = f"{got.dtype} {tuple(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__
        return False, f"got {what}, expected {want_dtype} {tuple(expected.shape)}"
    diff = got.double() != expected
    if diff.any():
        i = tuple(int(j) for j in diff.nonzero()[0])
        return (
            False,
            f"{int(diff.sum())} value(s) differ from torch.topk, first at local {i}: "
            f"expected {float(expected[i])}, got {float(got[i])}",
        )
    return True, "values equal torch.topk exactly"


def topk_ids_valid(got, expected, full, local, ctx):
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
        return False, (
            f"{int(bad.sum())} id(s) whose logit is not the top-k value, first at local {i}: "
            f"id {int(got[i])} has logit {float(picked[i])}, expected value {float(values[i])}"
        )
    return True, "every id's logit equals its top-k value"


# ---- where the rules come from --------------------------------------------------------------------------------

DOC = "docs/ops/model_utils.md"
OUTSIDE_VOCAB = ours("docs/ops/README.md#ids-outside-the-vocab")  # ids outside [0, V): -100, V+3
UNEVEN_VOCAB = ours(f"{DOC}#uneven-vocab-shards")  # V that TP does not split evenly, where the seed's is even
TEMPERATURE = ours(f"{DOC}#sampling-temperature")  # the op divides by sampling_params.temperature
TOP_K_ZERO = ours(f"{DOC}#top-k--top-p-filtering")  # top_k = 0 disables filtering ("None or -1" in the seed)
INT32_IDS = ours(f"{DOC}#index-dtype")  # int32 ids, where the seed states no index dtype: taken as the int64 ones
CHUNK_ROWS = ours(f"{DOC}#sampling-log-probs-top-k--top-p")  # a chunk's rows that TP does not divide: rounded up
CP_LAYOUT_OPEN = ours(f"{DOC}#cp-layouts-the-seed-leaves-open")  # CP input whose layout the seed does not state
# Where each property's rule comes from (docs/ops/model_utils.md#rules-seed-or-ours lists them).
RULES = {
    # chunking bounds memory and changes nothing else
    "property:chunked_equals_unchunked": seed(
        "'chunk_size – Chunk size for memory efficiency (in sequence dimension)'"
    ),
    # filtering comes before the log-softmax, so the probabilities are over the survivors and sum to 1
    "property:survivors_sum_to_1": seed("'Non-parallel: applies top-k/top-p filtering, log_softmax, and gather'"),
    # a sum of p·log p over a distribution is never positive
    "property:entropy_nonpositive": seed("ChunkedDistributedEntropy: 'Compute H_all = sum_v p_v log p_v across TP'"),
}


# The ops whose seed states the local vocab as an even split (quoted in docs/ops/model_utils.md#uneven-vocab-shards:
# `vocab_size//TP`, `vocab_size/tp_size`), or that derive their range from `vocab_parallel_rank` with no shapes stated:
# a V that TP does not divide is outside their seed.  The others take each rank's [vocab_start_index,
# vocab_end_index) and state no evenness: uneven shards are the seed's there, a rank holding none is not.
EVEN_VOCAB_OPS = {
    "model_utils._compute_distributed_log_softmax",
    "model_utils._compute_distributed_softmax",
    "model_utils.from_parallel_logits_to_logprobs",
    "model_utils.from_parallel_logits_to_logprobs_packed_sequences",
    "model_utils.dtensor_from_parallel_logits_to_logprobs",
    "model_utils.get_logprobs_from_vocab_parallel_logits",
    "model_utils.get_next_token_logprobs_from_logits",
    "model_utils.get_distillation_topk_logprobs_from_logits",
}


def _empty_vocab_shard(v: int, tp: int) -> bool:
    """Whether V split over TP as torch.chunk does leaves a TP rank nothing (V = 33 at TP 8: 5 each, the last 0)."""
    per_rank = -(-v // tp)
    return -(-v // per_rank) < tp


def outside_seed(case: Case) -> tuple[OutsideSeed, ...]:
    """What of `case`'s input the seed does not describe, and where (docs/ops/model_utils.md#rules-seed-or-ours)."""
    p = case.params
    out = []
    if p.get("masked"):
        out.append(OutsideSeed("targets outside [0, V)", OUTSIDE_VOCAB))
    if p.get("ids_int32"):
        out.append(OutsideSeed("int32 ids (the seed states no index dtype)", INT32_IDS))
    if p.get("temperature", 1.0) != 1.0:
        out.append(OutsideSeed("temperature ≠ 1 in sampling_params", TEMPERATURE))
    if p.get("top_k") is not None and p["top_k"] not in (-1,) and p["top_k"] <= 0:
        out.append(OutsideSeed("top_k = 0 (the seed disables with None or -1)", TOP_K_ZERO))
    v = p.get("V")
    if isinstance(v, int) and v > 0:
        if case.op in EVEN_VOCAB_OPS:
            out.append(OutsideSeed("V that TP does not divide", UNEVEN_VOCAB, lambda t, v=v: v % t.tp != 0))
        else:
            empty = OutsideSeed(
                "a TP rank holding no vocab entries", UNEVEN_VOCAB, lambda t, v=v: _empty_vocab_shard(v, t.tp)
            )
            out.append(empty)
    # CP inputs the seed leaves open (the seed gives a seq_index with CP-sharded logits; its plain path is non-parallel)
    if p.get("variant") == "shard1":
        out.append(OutsideSeed("CP-sharded DTensor logits without seq_index", CP_LAYOUT_OPEN, lambda t: t.cp > 1))
    if p.get("variant") == "plain" and case.op.endswith(".get_next_token_logprobs_from_logits"):
        plain = "context_parallel_group with plain full-vocab logits"
        out.append(OutsideSeed(plain, CP_LAYOUT_OPEN, lambda t: t.cp > 1))
    chunk, b = p.get("chunk_size"), p.get("B")
    if (p.get("top_k") or 0) > 0 or (p.get("top_p") or 1.0) < 1.0:  # through the sampling op's chunks
        if isinstance(chunk, int) and chunk > 0 and isinstance(b, int):
            rows = OutsideSeed("chunk rows (B·chunk_size) that TP does not divide", CHUNK_ROWS, _rows_split(b, chunk))
            out.append(rows)
    return tuple(out)


def _rows_split(b: int, chunk: int):
    """At which topologies a chunk's rows (the local batch times chunk_size) do not split over TP."""
    return lambda t: (max(b // t.dp, 1) * chunk) % t.tp != 0


def cited(cases: list[Case], bad_input: Rule) -> list[Case]:
    """A model_utils suite's cases, each testing TP ranks that hold no vocab entries (`empty_pieces`), with the
    family's rules; input the seed does not describe (targets outside [0, V), a temperature, V that TP does not divide
    where the seed's split is even, ...) is judged under our rule where it is so (`outside_seed`)."""
    out = cite([replace(c, empty_pieces=("tp",)) for c in cases], RULES, bad_input=bad_input)
    for case in out:
        if case.bad_input is None:  # a bad input is judged under its own rule
            case.outside_seed = outside_seed(case)
    return out
