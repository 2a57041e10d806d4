"""model_utils suites: the communication contracts (`Case.comm`, checked as `property:comm`), TP and CP."""

from __future__ import annotations

import torch

from shardcheck.suites._model_utils_inputs import Sampling

# ---- on the TP axis -------------------------------------------------------------------------
#
# Per rank and phase, {"<kind>@<mesh dim>": (calls, bytes)}: exactly what the correct implementation
# (distributed_impl/model_utils.py) does, so one more collective, call or byte fails the case.
# Notation: n = this rank's rows B_local·S (S the full sequence, also for next-token ops, which
# score S positions and drop the last), V_local = this rank's vocab shard, K = ids per position,
# c = number of chunks, e = bytes of the compute dtype (promote(dtype, float32)), e_in = bytes of
# the dtype the logits reach the op in.
# Bytes are what this rank sends (shardcheck.harness.core.measure.CommCounter): the elements it hands to the
# collective; an all-gather counts its own piece, an all-to-all its whole send buffer. Each
# contract is exactly what the reference implementation needs; its comment gives the lower bound.
# At tp = 1 the ops still call the collectives on a 1-rank group (free, but counted): same formulas.

AR, AG, A2A = "all_reduce@tp", "all_gather@tp", "all_to_all@tp"


def compute_bytes(ctx) -> int:
    """e: bytes of an element of the compute dtype (float32 or better)."""
    return torch.promote_types(ctx.dtype, torch.float32).itemsize


def rows(ctx, name: str = "logits") -> int:
    """n = B_local·S of a [B, S, ...] input."""
    b, s = ctx.local_shape(name)[:2]
    return b * s


def n_chunks(length: int, chunk: int | None) -> int:
    """c: the chunks of `chunk` positions a length splits into (one without a chunk size)."""
    return 1 if chunk is None else -(-length // chunk)


def merge(*phases: dict) -> dict:
    """The collectives of several phases' dicts added up, per kind."""
    out: dict = {}
    for phase in phases:
        for key, (calls, nbytes) in phase.items():
            c0, b0 = out.get(key, (0, 0))
            out[key] = (c0 + calls, b0 + nbytes)
    return out


def contract(fn):
    """fn(ctx) -> (forward, backward) dicts  ->  a Case.comm."""

    def comm(ctx) -> dict:
        fwd, bwd = fn(ctx)
        return {"forward": fwd, "backward": bwd}

    return comm


NO_COMM = contract(lambda ctx: ({}, {}))  # full-vocab (non-TP) paths: no collective at all


def softmax_comm(ctx, name: str = "logits") -> dict:
    """Distributed (log-)softmax: one MAX and one SUM all-reduce of a per-row scalar, 2 calls, 2·n·e.
    Lower bound: the full-vocab normaliser needs per-row scalars only, O(n) bytes, never a [n, V] gather."""
    return {AR: (2, 2 * rows(ctx, name) * compute_bytes(ctx))}


def logprob_comm(ctx, s: int, chunk: int | None = None, k: int = 1, grad: bool = True, name: str = "logits"):
    """Vocab-parallel log-probs at K ids per position (DistributedLogprob: chunk None, K 1;
    ChunkedDistributedLogprob / ChunkedDistributedGatherLogprob: chunk over S).
    forward: a log-softmax per chunk (2 calls, 2·n·e in all) + one SUM of [picked, owner count]
             (2·n·K·e): 2c + 1 calls, (2 + 2K)·n·e;
    backward: unchunked none (the saved softmax is local); chunked recomputes each chunk's softmax:
             2c calls, 2·n·e.
    Lower bound: per-row scalars and the K picked values only: O(n·K) bytes, never a [n, V] gather;
    no backward communication (the chunked backward's recompute trades 2·n·e for O(chunk·V_local) memory)."""
    n, e = rows(ctx, name), compute_bytes(ctx)
    c = n_chunks(s, chunk)
    fwd = {AR: (2 * c + 1, (2 + 2 * k) * n * e)}
    bwd = {AR: (2 * c, 2 * n * e)} if grad and chunk is not None else {}
    return fwd, bwd


def cross_entropy_comm(ctx):
    """DistributedCrossEntropy: softmax(target) and log_softmax(student) (2 calls each) + one SUM of the
    per-row partial H(p, q): 5 calls, 5·n·e; backward none ((q - p)·g is local).
    Lower bound: per-row scalars only, O(n), never a [n, V] gather."""
    return {AR: (5, 5 * rows(ctx, "student_logits") * compute_bytes(ctx))}, {}


def entropy_comm(ctx, s: int, chunk: int, name: str = "logits"):
    """ChunkedDistributedEntropy: a log-softmax per chunk (2 calls, 2·n·e in all) + one SUM of the
    per-row partial Σ p log p (n·e): 2c + 1 calls, 3·n·e; backward recomputes the softmax per chunk:
    2c calls, 2·n·e. Lower bound: per-row scalars only, O(n), never a [n, V] gather."""
    n, e = rows(ctx, name), compute_bytes(ctx)
    c = n_chunks(s, chunk)
    return {AR: (2 * c + 1, 3 * n * e)}, {AR: (2 * c, 2 * n * e)}


def gather_logits_comm(ctx, k: int, name: str = "logits"):
    """gather_logits_at_global_indices over TP: each id's owner contributes its logit, one SUM of
    [n, K]: 1 call, n·K·e; backward none. Lower bound: the K picked values, O(n·K)."""
    return {AR: (1, rows(ctx, name) * k * compute_bytes(ctx))}, {}


def topk_comm(ctx, s: int, k: int, chunk: int | None):
    """distributed_vocab_topk: per chunk one all-gather of this rank's k candidate values (e) and one
    of their int64 ids: 2c calls, n·k·(e + 8) bytes sent. No backward.
    Lower bound: O(n·k) candidates per rank, never the [n, V_local] shard."""
    return {AG: (2 * n_chunks(s, chunk), rows(ctx) * k * (compute_bytes(ctx) + 8))}, {}


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
    n, tp = rows(ctx), ctx.size("tp")
    b_local = ctx.local_shape("logits")[0]
    v_local = ctx.local_shape("logits")[-1]
    rows_per_chunk = n if chunk is None else min(n, -(-chunk * b_local // tp) * tp)
    c = -(-n // rows_per_chunk)
    shard = n * v_local * e_in
    fwd = {AG: (2, 3 * 8 + n // tp * compute_bytes(ctx)), A2A: (c, shard)}
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
    Plus the suite's own DDP stand-in (shardcheck.GradSum): one all_reduce@dp of the [V_local, H]
    weight gradient (compute dtype) in the backward when dp > 1.
    Lower bound: sequence-parallel input needs the [S, B, H] gather (O(S·B·H), independent of V) and a
    reduce-scatter of its gradient; the vocab side per-row scalars only, never [B, S, V] logits."""
    s_local, b, h = ctx.local_shape("hidden")
    v_local = ctx.local_shape("weight")[0]
    e, e_in = compute_bytes(ctx), ctx.dtype.itemsize
    c = n_chunks(s, chunk)
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


def next_token_comm(ctx, s: int, smp: Sampling, chunk: int | None, grad: bool = True):
    """from_parallel_logits_to_logprobs (and the front ends over it): the plain, chunked or sampling path.
    Unchunked with a temperature, the logits are upcast (and scaled) before the op: e_in = e."""
    if smp.filtering:
        e_in = compute_bytes(ctx) if chunk is None and smp.temperature != 1.0 else ctx.dtype.itemsize
        return sampling_comm(ctx, chunk, e_in, grad)
    return logprob_comm(ctx, s, chunk, grad=grad)


def distillation_comm(ctx, s: int, k: int, zero: bool, entropy: bool):
    """get_distillation_topk_logprobs_from_logits on the TP (group or DTensor) path, chunk = min(S, 1024):
    zero_outside_topk: ChunkedDistributedGatherLogprob at the K ids (logprob_comm with K), else
    gather_logits_at_global_indices (one SUM of [n, K]); calculate_entropy adds ChunkedDistributedEntropy.
    The teacher side is local. DTensor student logits add nothing (to_local / from_local are local)."""
    chunk = max(1, min(s, 1024))
    fwd, bwd = (
        logprob_comm(ctx, s, chunk, k=k, name="student_logits")
        if zero
        else gather_logits_comm(ctx, k, name="student_logits")
    )
    if entropy:
        f2, b2 = entropy_comm(ctx, s, chunk, name="student_logits")
        fwd, bwd = merge(fwd, f2), merge(bwd, b2)
    return fwd, bwd


# ---- on the CP axis -------------------------------------------------------------------------
#
# On top of each op's TP collectives: the per-token result all-gathered over
# CP (this rank sends its local piece, numel_local·e) and, in the backward, one all-to-all of the
# full-sequence gradient (this rank's send buffer: CP·numel_local·e), summed locally.
# Lower bound: per-token scalars only, O(B·S), never [B, S, V] logits over CP; a reduce-scatter would
# send (CP−1)/CP of the all-to-all's buffer (gloo has none on CPU). At cp = 1 nothing is gathered.

AG_CP, A2A_CP = "all_gather@cp", "all_to_all@cp"


def cp_gather_comm(ctx, numel_local: int, itemsize: int, grad: bool = True):
    """(forward, backward) of all-gathering a per-token result of numel_local elements over CP."""
    cp = ctx.size("cp")
    if cp == 1:
        return {}, {}
    return {AG_CP: (1, numel_local * itemsize)}, ({A2A_CP: (1, cp * numel_local * itemsize)} if grad else {})


def with_cp_gather(tp_contract, numel_local_of, ids_gather: bool = False, grad: bool = True):
    """A Case.comm: `tp_contract(ctx)` + the CP gather of a per-token result of numel_local_of(ctx)
    elements in the compute dtype (+ one all-gather of the int64 ids for DTensor targets)."""

    def both(ctx):
        fwd, bwd = tp_contract(ctx)
        f2, b2 = cp_gather_comm(ctx, numel_local_of(ctx), compute_bytes(ctx), grad)
        fwd, bwd = merge(fwd, f2), merge(bwd, b2)
        if ids_gather and ctx.size("cp") > 1:
            fwd = merge(fwd, {AG_CP: (1, rows(ctx) * 8)})
        return fwd, bwd

    return contract(both)


def s_local(ctx, name: str = "logits") -> int:
    """This rank's sequence length (S/CP) of a [B, S, ...] input."""
    return ctx.local_shape(name)[1]
