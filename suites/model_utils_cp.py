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
"""

from __future__ import annotations

from functools import partial

import torch
from torch.distributed.tensor import Partial, Shard

from harness.case import REPLICATED, BadInput, Case, GradSum, HeadTail, Layout, PackedHeadTail, Permuted
from reference import model_utils as ref
from suites.model_utils import (Sampling, _contract, _distill_inputs, _dtensor, _e, _hidden_inputs,
                                _make_indices, _merge, _rows, _sampling_inputs, _sampling_params, distillation_comm,
                                gather_logits_comm, hidden_comm, make_logits, next_token_comm)

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
SUMMED = ("cp",)  # every CP rank's full-sequence result is its own summand of the loss

S = 16  # divisible by 2·CP for CP 1, 2, 4
PADDED = 13  # a target length that is not: padded to 16 by the op


def _cp_fits(b: int, tp_rows: int | None = None, v: int | None = None):
    """B divides over DP; for the all-to-all (sampling) paths the local rows B_local·S/CP split over
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


# ---- communication contracts ---------------------------------------------------------------
#
# On top of each op's TP collectives (suites/model_utils.py): the per-token result all-gathered over
# CP (this rank sends its local piece, numel_local·e) and, in the backward, one all-to-all of the
# full-sequence gradient (this rank's send buffer: CP·numel_local·e), summed locally.
# Lower bound: per-token scalars only, O(B·S), never [B, S, V] logits over CP; a reduce-scatter would
# send (CP−1)/CP of the all-to-all's buffer (gloo has none on CPU). At cp = 1 nothing is gathered.

AG_CP, A2A_CP = "all_gather@cp", "all_to_all@cp"


def cp_gather_comm(ctx, numel_local: int, itemsize: int, grad: bool = True):
    cp = ctx.size("cp")
    if cp == 1:
        return {}, {}
    return {AG_CP: (1, numel_local * itemsize)}, ({A2A_CP: (1, cp * numel_local * itemsize)} if grad else {})


def _with_cp_gather(tp_contract, numel_local_of, ids_gather: bool = False, grad: bool = True):
    """contract(ctx) = the TP contract + the CP gather of a per-token result of numel_local_of(ctx)
    elements in the compute dtype (+ one all-gather of the int64 ids for DTensor targets)."""
    def contract(ctx):
        fwd, bwd = tp_contract(ctx)
        f2, b2 = cp_gather_comm(ctx, numel_local_of(ctx), _e(ctx), grad)
        fwd, bwd = _merge(fwd, f2), _merge(bwd, b2)
        if ids_gather and ctx.size("cp") > 1:
            fwd = _merge(fwd, {AG_CP: (1, _rows(ctx) * 8)})
        return fwd, bwd
    return _contract(contract)


def _s_local(ctx, name: str = "logits") -> int:
    return ctx.local_shape(name)[1]


# ---- the layout ops --------------------------------------------------------------------------

def layout_cases(quick: bool) -> list[Case]:
    cases = []
    # _get_tokens_on_this_cp_rank: the full input on every rank, its head-tail piece out (any dtype, any seq_dim).
    specs = [((2, 16), 1, "int64"), ((16, 3, 4), 0, "float"), ((2, 3, 16), 2, "float"), ((2, 8, 5), 1, "bool")]
    for shape, seq_dim, kind in specs[:2] if quick else specs:
        def make(gen, shape=shape, kind=kind):
            if kind == "int64":
                return {"x": torch.randint(0, 1000, shape, generator=gen)}
            if kind == "bool":
                return {"x": torch.rand(shape, generator=gen) < 0.5}
            return {"x": make_logits(gen, shape)}
        cases.append(Case(
            op=OP + "_get_tokens_on_this_cp_rank", case_id=_case_id("x" + "x".join(map(str, shape)), kind, f"seqdim{seq_dim}"),
            params={"shape": list(shape), "seq_dim": seq_dim, "kind": kind}, make_inputs=make,
            reference=lambda x: x["x"].clone(),  # the layout of the full tensor: the harness's HeadTail rule slices it
            run=lambda impl, ctx, x, seq_dim=seq_dim: impl._get_tokens_on_this_cp_rank(
                x["x"], ctx.rank("cp"), ctx.size("cp"), seq_dim=seq_dim),
            output_layouts=(Layout(cp=HeadTail(seq_dim)),), dtypes=("float64",) if kind != "float" else
            ("float64", "float32", "bfloat16"), supports=lambda t: t.tp == 1 and t.dp == 1,
            comm=_contract(lambda ctx: ({}, {}))))  # a local slice: no collective at all
    # A length not divisible by 2·CP: no layout is documented for it, so the op must raise (never drop a tail).
    cases.append(Case(
        op=OP + "_get_tokens_on_this_cp_rank", case_id="x2x6-not-divisible", params={"shape": [2, 6], "seq_dim": 1},
        make_inputs=lambda gen: {"x": torch.randint(0, 100, (2, 6), generator=gen)}, reference=lambda x: None,
        run=lambda impl, ctx, x: impl._get_tokens_on_this_cp_rank(x["x"], ctx.rank("cp"), ctx.size("cp"), seq_dim=1),
        bad_input=BadInput("a sequence of 6 tokens, not divisible by 2·CP = 8"), dtypes=("float64",), context_parallel=True,
        supports=lambda t: t.cp == 4 and t.dp == 1 and t.tp == 1))

    # AllGatherCPTensor / allgather_cp_sharded_tensor: head-tail pieces in, the full tensor on every rank.
    # "sum_last"/"sum_all" hand the backward an expanded upstream gradient (what out.sum().backward() gives).
    gather_specs = [("allgather_cp_sharded_tensor", (4, 16, 3), 1, "none"),
                    ("allgather_cp_sharded_tensor", (16, 2, 3), 0, "sum_last"),
                    ("AllGatherCPTensor", (2, 3, 16), 2, "sum_all"),
                    ("AllGatherCPTensor", (4, 16, 3), 1, "sum_last")]
    for op, shape, seq_dim, reduce in gather_specs[1:3] if quick else gather_specs:
        batch_dim = 1 if seq_dim == 0 else 0
        layout = Layout(dp=Shard(batch_dim), cp=HeadTail(seq_dim))
        # a sum over everything is a per-DP-rank partial sum of the global one
        out_layout = Layout(dp=Partial()) if reduce == "sum_all" else Layout(dp=Shard(batch_dim))

        def finish(y, reduce=reduce):
            return y.sum(-1) if reduce == "sum_last" else y.sum() if reduce == "sum_all" else y

        def run(impl, ctx, x, op=op, seq_dim=seq_dim, finish=finish):
            if op == "AllGatherCPTensor":
                return finish(impl.AllGatherCPTensor.apply(x["x"], ctx.group("cp"), seq_dim))
            return finish(impl.allgather_cp_sharded_tensor(x["x"], ctx.group("cp"), seq_dim=seq_dim))

        def contract(ctx, seq_dim=seq_dim):
            numel = 1
            for n in ctx.local_shape("x"):
                numel *= n
            e_in = ctx.dtype.itemsize
            return {AG_CP: (1, numel * e_in)}, {A2A_CP: (1, ctx.size("cp") * numel * e_in)}

        cases.append(Case(
            op=OP + op, case_id=_case_id("x" + "x".join(map(str, shape)), f"seqdim{seq_dim}", reduce),
            params={"shape": list(shape), "seq_dim": seq_dim, "upstream": reduce},
            make_inputs=lambda gen, shape=shape: {"x": make_logits(gen, shape)},
            reference=lambda x, finish=finish: finish(x["x"] * 1.0), run=run, input_layouts={"x": layout},
            output_layouts=(out_layout,), grad_inputs=("x",), summed_over=SUMMED, comm=_contract(contract),
            supports=lambda t, shape=shape, batch_dim=batch_dim: shape[batch_dim] % t.dp == 0 and t.tp == 1))
    return cases


# ---- next-token log-probs: from_parallel_logits_to_logprobs and its fronts --------------------

def _next_token_inputs(gen, b, v, smp: Sampling, target_len: int = S, masked: float = 0.0, scale: float = 3.0,
                       ties: bool = False):
    """Logits [B, S, V]; an unshifted target [B, target_len] (the op pads a shorter one)."""
    x = _sampling_inputs(gen, b, S, v, smp, scale=scale, ties=ties, masked=masked, shift=True)
    x["target"] = x["target"][:, :target_len].contiguous()
    return x


def _next_token_ref(smp: Sampling):
    def reference(x):
        n = x["target"].shape[1]  # positions past the target (padding) are not scored
        if smp == Sampling():
            return ref.next_token_logprobs(x["logits"][:, :n], x["target"])
        return ref.next_token_sampling_logprobs(x["logits"][:, :n], x["target"], smp.top_k, smp.top_p, smp.temperature)
    return reference


# (B, V, extra, sampling, chunk, target_len)
FROM_PARALLEL_SPECS = [
    (4, 37, {"masked": 0.2}, Sampling(), None, S),  # uneven vocab shards, masked targets
    (2, 24, {}, Sampling(), 3, PADDED),  # chunked (3 does not divide S/CP), padded target
    (2, 32, {"ties": True}, Sampling(top_k=5, top_p=0.9, temperature=0.7), None, S),  # sampling, ties at the k-th
    (2, 32, {"masked": 0.2}, Sampling(top_k=4, temperature=1.5), 2, PADDED),  # chunked sampling, padded
    (2, 33, {"scale": 300.0}, Sampling(), None, PADDED),  # huge logits
]


def from_parallel_cases(quick: bool) -> list[Case]:
    cases = []
    specs = [FROM_PARALLEL_SPECS[1], FROM_PARALLEL_SPECS[3]] if quick else FROM_PARALLEL_SPECS
    for b, v, extra, smp, chunk, n in specs:
        def run(impl, ctx, x, smp=smp, chunk=chunk):
            start, end = ctx.local_range("logits", -1)
            return impl.from_parallel_logits_to_logprobs(
                x["logits"], x["target"], start, end, ctx.group("tp"), cp_group=ctx.group("cp"), chunk_size=chunk,
                sampling_params=_sampling_params(smp) if smp != Sampling() else None)
        cases.append(Case(
            op=OP + "from_parallel_logits_to_logprobs",
            case_id=_case_id(f"cp-b{b}s{S}v{v}", f"target{n}" if n != S else "", smp.tag(), f"chunk{chunk}",
                             *[f"{k}{x}" for k, x in extra.items()]),
            params={"B": b, "S": S, "V": v, "target_len": n, "chunk_size": chunk, **extra, **smp.params()},
            make_inputs=partial(_next_token_inputs, b=b, v=v, smp=smp, target_len=n, **extra),
            reference=_next_token_ref(smp), run=run,
            input_layouts={"logits": CP_LOGITS, "target": BATCH}, output_layouts=(BATCH,), grad_inputs=("logits",),
            summed_over=SUMMED, supports=_cp_fits(b, S, v) if smp.filtering else _cp_fits(b),
            comm=_with_cp_gather(lambda ctx, smp=smp, chunk=chunk: next_token_comm(ctx, _s_local(ctx), smp, chunk),
                                 lambda ctx: _rows(ctx))))
    return cases


def _permutation(gen, kind: str) -> torch.Tensor:
    if kind == "random":
        return torch.randperm(S, generator=gen)
    # the head-tail layout of CP = 2 written as a permutation (how a trainer describes it)
    return torch.cat([torch.arange(0, 4), torch.arange(12, 16), torch.arange(4, 12)])


def front_end_cp_cases(quick: bool) -> list[Case]:
    """dtensor_from_parallel_logits_to_logprobs (seq_index), get_logprobs_from_vocab_parallel_logits (DTensor
    logits, seq_index or the DTensor's own Shard(1)), get_next_token_logprobs_from_logits (its three paths)."""
    # (op, variant, B, V, extra, sampling, chunk, permutation)
    specs = [
        ("dtensor_from_parallel_logits_to_logprobs", "seq_index", 4, 37, {"masked": 0.2}, Sampling(), None, "random"),
        ("dtensor_from_parallel_logits_to_logprobs", "seq_index", 2, 32, {}, Sampling(top_k=5, temperature=0.7), 3, "head_tail"),
        ("get_logprobs_from_vocab_parallel_logits", "seq_index", 2, 37, {}, Sampling(), 2, "random"),
        ("get_logprobs_from_vocab_parallel_logits", "shard1", 4, 24, {"masked": 0.2}, Sampling(top_p=0.8), None, None),
        ("get_next_token_logprobs_from_logits", "vocab_parallel_group", 2, 32, {"masked": 0.2}, Sampling(), None, None),
        ("get_next_token_logprobs_from_logits", "plain", 2, 24, {}, Sampling(top_k=4, temperature=1.3), None, None),
        ("get_next_token_logprobs_from_logits", "dtensor", 2, 32, {}, Sampling(temperature=1.5), None, "random"),
    ]
    if quick:
        specs = [specs[0], specs[3], specs[4], specs[5]]
    cases = []
    for op, variant, b, v, extra, smp, chunk, perm in specs:
        if variant == "plain":
            logits_layout, ids_layout = CP_BATCH, BATCH
        elif variant == "vocab_parallel_group":
            logits_layout, ids_layout = CP_LOGITS, BATCH
        elif perm is None:
            logits_layout, ids_layout = CONTIG_LOGITS, CONTIG_IDS
        else:
            logits_layout, ids_layout = PERM_LOGITS, PERM_IDS

        def make(gen, b=b, v=v, smp=smp, extra=extra, perm=perm):
            x = _next_token_inputs(gen, b, v, smp, **extra)
            if perm is not None:
                x["seq_index"] = _permutation(gen, perm)
            return x

        def run(impl, ctx, x, op=op, variant=variant, smp=smp, chunk=chunk, logits_layout=logits_layout,
                ids_layout=ids_layout):
            sp = _sampling_params(smp) if smp != Sampling() else None
            seq_index = x.get("seq_index")
            ids = _dtensor(ctx, x["target"], "target", ids_layout)
            if op == "dtensor_from_parallel_logits_to_logprobs":
                start, end = ctx.local_range("logits", -1)
                return impl.dtensor_from_parallel_logits_to_logprobs(
                    x["logits"], ids, start, end, ctx.group("tp"), seq_index=seq_index, chunk_size=chunk,
                    sampling_params=sp)
            logits = _dtensor(ctx, x["logits"], "logits", logits_layout)
            if op == "get_logprobs_from_vocab_parallel_logits":
                return impl.get_logprobs_from_vocab_parallel_logits(logits, ids, seq_index=seq_index, chunk_size=chunk,
                                                                    sampling_params=sp)
            if variant == "dtensor":
                return impl.get_next_token_logprobs_from_logits(ids, logits, seq_index=seq_index, sampling_params=sp)
            kw = dict(vocab_parallel_rank=ctx.rank("tp"), vocab_parallel_group=ctx.group("tp")) \
                if variant == "vocab_parallel_group" else {}
            return impl.get_next_token_logprobs_from_logits(x["target"], x["logits"], context_parallel_group=ctx.group("cp"),
                                                            sampling_params=sp, **kw)

        replicated = variant == "plain"
        ids_gather = ids_layout is not BATCH and op != "get_next_token_logprobs_from_logits" or variant == "dtensor"
        tp_contract = (lambda ctx: ({}, {})) if replicated else \
            (lambda ctx, smp=smp, chunk=chunk: next_token_comm(ctx, _s_local(ctx), smp, chunk))
        even = variant == "vocab_parallel_group"
        supports = _cp_fits(b) if replicated else _cp_fits(b, S if smp.filtering else None, v if smp.filtering or even else None)
        cases.append(Case(
            op=OP + op, case_id=_case_id("cp", variant, f"b{b}s{S}v{v}", smp.tag(), f"chunk{chunk}" if chunk else "",
                                         perm and f"perm_{perm}", *[f"{k}{x}" for k, x in extra.items()]),
            params={"variant": variant, "B": b, "S": S, "V": v, "chunk_size": chunk, "permutation": perm, **extra,
                    **smp.params()},
            make_inputs=make, reference=_next_token_ref(smp), run=run,
            input_layouts={"logits": logits_layout, "target": ids_layout}, output_layouts=(BATCH,),
            grad_inputs=("logits",), summed_over=SUMMED, supports=supports,
            comm=_with_cp_gather(tp_contract, lambda ctx: _rows(ctx), ids_gather=ids_gather)))
    return cases


# ---- gathers at global ids, distillation, hidden states -------------------------------------

def gather_cp_cases(quick: bool) -> list[Case]:
    specs = [(4, 37, 5, {"masked": 0.2}, "tp"), (2, 32, 4, {"scale": 300.0}, "tp"), (2, 24, 3, {}, "none"),
             (2, 37, 4, {"neg_inf": 0.3}, "tp")]  # ids on -inf logits, through the TP sum and the CP gather
    cases = []
    for b, v, k, extra, group in specs[2:] if quick else specs:
        def make(gen, b=b, v=v, k=k, extra=extra):
            logits = make_logits(gen, (b, S, v), **{key: x for key, x in extra.items() if key != "masked"})
            return {"logits": logits, "indices": _make_indices(gen, b, S, k, v, dup=True, masked=extra.get("masked", 0.0))}

        def run(impl, ctx, x, group=group, v=v):
            start, end = ctx.local_range("logits", -1) if group == "tp" else (0, v)
            return impl.gather_logits_at_global_indices(
                x["logits"], x["indices"], ctx.group("tp") if group == "tp" else None, ctx.group("cp"),
                vocab_start_index=start, vocab_end_index=end)

        tp_contract = (lambda ctx, k=k: gather_logits_comm(ctx, k)) if group == "tp" else (lambda ctx: ({}, {}))
        cases.append(Case(
            op=OP + "gather_logits_at_global_indices",
            case_id=_case_id(f"cp-b{b}s{S}v{v}-k{k}-dup", f"tp_group_{group}", *[f"{kk}{x}" for kk, x in extra.items()]),
            params={"B": b, "S": S, "V": v, "K": k, "tp_group": group, **extra}, make_inputs=make,
            reference=lambda x: ref.gather_logits(x["logits"], x["indices"]), run=run,
            input_layouts={"logits": CP_LOGITS if group == "tp" else CP_BATCH, "indices": BATCH},
            output_layouts=(BATCH,), grad_inputs=("logits",), summed_over=SUMMED, supports=_cp_fits(b),
            comm=_with_cp_gather(tp_contract, lambda ctx, k=k: _rows(ctx) * k)))
    return cases


def distillation_cp_cases(quick: bool) -> list[Case]:
    # (B, V, K, extra, zero_outside_topk, calculate_entropy, path)
    specs = [(2, 32, 4, {}, False, True, "group"), (2, 32, 4, {}, True, True, "group"),
             (4, 24, 3, {"ties": True}, True, False, "plain"), (2, 32, 4, {"scale": 300.0}, False, False, "group")]
    cases = []
    for b, v, k, extra, zero, ent, path in specs[:2] if quick else specs:
        def run(impl, ctx, x, zero=zero, ent=ent, path=path):
            kw = dict(vocab_parallel_rank=ctx.rank("tp"), vocab_parallel_group=ctx.group("tp")) if path == "group" else {}
            return impl.get_distillation_topk_logprobs_from_logits(
                x["student_logits"], x["teacher_topk_logits"], x["teacher_topk_indices"], zero, ent,
                context_parallel_group=ctx.group("cp"), **kw)

        def contract(ctx, zero=zero, ent=ent, k=k, path=path):
            fwd, bwd = distillation_comm(ctx, _s_local(ctx, "student_logits"), k, zero, ent) if path == "group" else ({}, {})
            rows = _rows(ctx, "student_logits")
            for numel in [rows * k] + ([rows] if ent else []):  # student log-probs, then H_all
                f2, b2 = cp_gather_comm(ctx, numel, _e(ctx))
                fwd, bwd = _merge(fwd, f2), _merge(bwd, b2)
            return fwd, bwd

        cases.append(Case(
            op=OP + "get_distillation_topk_logprobs_from_logits",
            case_id=_case_id(f"cp-b{b}s{S}v{v}-k{k}", f"zero_outside_{zero}", f"entropy_{ent}", path,
                             *[f"{kk}{x}" for kk, x in extra.items()]),
            params={"B": b, "S": S, "V": v, "K": k, "zero_outside_topk": zero, "calculate_entropy": ent, "path": path,
                    **extra},
            make_inputs=partial(_distill_inputs, b=b, s=S, v=v, k=k, extra=extra),
            reference=lambda x, zero=zero, ent=ent: ref.distillation_topk_logprobs(
                x["student_logits"], x["teacher_topk_logits"], x["teacher_topk_indices"], zero, ent),
            run=run, input_layouts={"student_logits": CP_LOGITS if path == "group" else CP_BATCH,
                                    "teacher_topk_logits": BATCH, "teacher_topk_indices": BATCH},
            output_layouts=(BATCH, BATCH, BATCH if ent else REPLICATED), output_names=("student", "teacher", "H_all"),
            grad_inputs=("student_logits",), summed_over=SUMMED,
            supports=_cp_fits(b, v=v) if path == "group" else _cp_fits(b), comm=_contract(contract)))
    return cases


HIDDEN_CP = Layout(dp=Shard(1), cp=HeadTail(0), tp=Shard(0))  # [S, B, H]: head-tail over CP, then SP over TP
WEIGHT = Layout(tp=Shard(0))


def hidden_states_cp_cases(quick: bool) -> list[Case]:
    # (B, H, V, extra, chunk, target_len)
    specs = [(2, 8, 32, {}, None, S), (2, 6, 37, {"masked": 0.2}, 3, PADDED), (4, 8, 24, {"scale": 3.0}, 2, S)]
    cases = []
    for b, h, v, extra, chunk, n in specs[1:2] if quick else specs:
        def make(gen, b=b, h=h, v=v, extra=extra, n=n):
            x = _hidden_inputs(gen, S, b, h, v, **extra)
            x["target"] = x["target"][:, :n].contiguous()
            return x

        def run(impl, ctx, x, chunk=chunk):
            weight = GradSum.apply(x["weight"], (ctx.group("dp"), ctx.group("cp")))
            return impl.from_parallel_hidden_states_to_logprobs(
                x["hidden"], None, weight, False, x["target"], *ctx.local_range("weight", 0), ctx.group("tp"),
                cp_group=ctx.group("cp"), chunk_size=chunk)

        def contract(ctx, chunk=chunk):
            s_cp = S // ctx.size("cp")
            fwd, bwd = hidden_comm(ctx, s_cp, chunk)
            if ctx.size("cp") > 1:  # the DDP stand-in sums the weight gradient over CP too
                bwd = _merge(bwd, {"all_reduce@cp": (1, ctx.local_shape("weight")[0] * ctx.full_shapes["weight"][1] * _e(ctx))})
            f2, b2 = cp_gather_comm(ctx, ctx.local_shape("hidden")[1] * s_cp, _e(ctx))
            return _merge(fwd, f2), _merge(bwd, b2)

        cases.append(Case(
            op=OP + "from_parallel_hidden_states_to_logprobs",
            case_id=_case_id(f"cp-s{S}b{b}h{h}v{v}", f"target{n}" if n != S else "", f"chunk{chunk}",
                             *[f"{k}{x}" for k, x in extra.items()]),
            params={"S": S, "B": b, "H": h, "V": v, "target_len": n, "chunk_size": chunk, **extra}, make_inputs=make,
            reference=lambda x: ref.hidden_states_to_logprobs(x["hidden"][: x["target"].shape[1]], x["weight"], x["target"]),
            run=run, input_layouts={"hidden": HIDDEN_CP, "weight": WEIGHT, "target": BATCH}, output_layouts=(BATCH,),
            grad_inputs=("hidden", "weight"), summed_over=SUMMED, comm=_contract(contract),
            supports=lambda t, b=b: b % t.dp == 0 and (S // t.cp) % t.tp == 0))
    return cases


# ---- packed sequences ------------------------------------------------------------------------

# (padded lengths, real lengths, V, extra, sampling, chunk, pre_rolled, unpacked_seqlen)
PACKED_SPECS = [
    ((8, 16, 8), (5, 16, 8), 37, {"masked": 0.1}, Sampling(), None, False, 16),  # unequal lengths, uneven vocab
    ((16, 8), (11, 3), 32, {}, Sampling(), 3, True, 20),  # pre-rolled, chunked, rows wider than any sequence
    ((8, 8, 16), (8, 6, 9), 32, {}, Sampling(top_k=5, temperature=0.8), None, False, 12),  # sampling; row 3 truncated
    ((16, 16), (16, 12), 24, {"scale": 300.0}, Sampling(), 2, False, 16),  # huge logits, chunked
]


def _packed_inputs(gen, padded, real, v, smp: Sampling, pre_rolled: bool, masked: float = 0.0, scale: float = 3.0,
                   pad_id: int = 0):
    """One packed row of sequences (padded to `padded`, real tokens `real`, pad id after them),
    its logits and cu_seqlens_padded; with `pre_rolled` the target is already shifted per sequence."""
    T = sum(padded)
    x = _sampling_inputs(gen, 1, T, v, smp, scale=scale, masked=masked)
    target = x["target"].clone()
    start = 0
    for p, r in zip(padded, real):
        target[:, start + r:start + p] = pad_id  # padding tokens, as a packer writes them
        start += p
    bounds = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()])
    if pre_rolled:
        target = torch.cat([target[:, a:b].roll(-1, dims=1) for a, b in zip(bounds[:-1], bounds[1:])], dim=1)
    return {"logits": x["logits"], "target": target, "cu_seqlens_padded": bounds}


def packed_cases(quick: bool) -> list[Case]:
    cases = []
    for padded, real, v, extra, smp, chunk, pre_rolled, unpacked in PACKED_SPECS[:2] if quick else PACKED_SPECS:
        def run(impl, ctx, x, smp=smp, chunk=chunk, pre_rolled=pre_rolled, unpacked=unpacked):
            start, end = ctx.local_range("logits", -1)
            return impl.from_parallel_logits_to_logprobs_packed_sequences(
                x["logits"], x["target"], x["cu_seqlens_padded"], unpacked, start, end, ctx.group("tp"),
                cp_group=ctx.group("cp"), chunk_size=chunk,
                sampling_params=_sampling_params(smp) if smp != Sampling() else None,
                target_is_pre_rolled=pre_rolled)

        def tp_contract(ctx, smp=smp, chunk=chunk):
            return next_token_comm(ctx, _s_local(ctx), smp, chunk)

        T = sum(padded)
        cases.append(Case(
            op=OP + "from_parallel_logits_to_logprobs_packed_sequences",
            case_id=_case_id("packed", "-".join(f"{r}of{p}" for p, r in zip(padded, real)), f"v{v}", smp.tag(),
                             f"chunk{chunk}", "pre_rolled" if pre_rolled else "", f"unpacked{unpacked}",
                             *[f"{k}{x}" for k, x in extra.items()]),
            params={"padded": list(padded), "real": list(real), "V": v, "chunk_size": chunk, "pre_rolled": pre_rolled,
                    "unpacked_seqlen": unpacked, **extra, **smp.params()},
            make_inputs=partial(_packed_inputs, padded=padded, real=real, v=v, smp=smp, pre_rolled=pre_rolled, **extra),
            reference=lambda x, smp=smp, pre_rolled=pre_rolled, unpacked=unpacked: ref.packed_next_token_logprobs(
                x["logits"], x["target"], x["cu_seqlens_padded"], unpacked, pre_rolled, smp.top_k, smp.top_p,
                smp.temperature),
            run=run, input_layouts={"logits": PACKED_LOGITS, "target": PACKED_IDS if pre_rolled else REPLICATED},
            output_layouts=(REPLICATED,), grad_inputs=("logits",), summed_over=SUMMED,
            supports=lambda t, T=T, v=v, smp=smp: t.dp == 1 and (not smp.filtering or ((T // t.cp) % t.tp == 0 and v % t.tp == 0)),
            comm=_with_cp_gather(tp_contract, lambda ctx: _rows(ctx))))
    return cases


def cases(quick: bool = False) -> list[Case]:
    return (layout_cases(quick) + from_parallel_cases(quick) + front_end_cp_cases(quick) + gather_cp_cases(quick)
            + distillation_cp_cases(quick) + hidden_states_cp_cases(quick) + packed_cases(quick))
