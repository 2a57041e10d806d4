"""Suite for the Megatron-Core linear-CE fusion of model_utils (seed 001):
`patch_gpt_model_forward_for_linear_ce_fusion` and `_gpt_forward_with_linear_ce_fusion`, on a tiny Megatron-Core
GPTModel (suites/_megatron_model.py: 2 layers, hidden 64, 4 heads, vocab 128, S 16, RoPE), tied and untied embeddings,
TP 1, 2, 4 (sequence parallel at TP > 1).

Needs the optional extra `pip install -e .[megatron]`; without megatron-core every case is recorded `skip` with the
reason. Only (dp, cp) = (1, 1) topologies (and cp = 2 for the case checking that CP is refused): the model's TP group
is the mesh's "tp" group, handed to Megatron through a `ProcessGroupCollection` (Megatron's global parallel_state is
never initialised, so a tp2 topology inside a 4-rank launch is fine: spare ranks wait, as for any case).

How the model enters: every parameter of the *single-device* model (TP = 1) is a case input named by its parameter
name (`decoder.layers.0.mlp.linear_fc1.weight`, ...), with its TP layout: column-parallel weights/biases and the
embedding / output weights `Shard(0)`, row-parallel weights `Shard(1)`, norms and row-parallel biases replicated. Each
rank runs its TP-sharded GPTModel with `torch.func.functional_call` on its local pieces, so the gradient of every
parameter lands on the harness's local input and is compared, on every rank, with its slice of the golden gradient.
Replicated parameters used on a sequence shard (norms, row-parallel biases: Megatron tags them `sequence_parallel`)
get partial gradients; the case sums them over TP as Megatron's finalize_model_grads does (shardcheck.GradSum).

The model case (suites/_model_utils_megatron_gpt.py, `model-untied` / `model-tied`): the same GPTModel as a
shardcheck.ModelCase, one training step with the patched forward (flag off) checked module by module against the
single-device model, every parameter's gradient and stepped value, in float64, float32 and bfloat16.

Golden (`reference`): the unpatched single-device model's logits -> log-softmax in float64 (float32 for lower
precisions) -> gathered at the shifted labels; 0 where a label is outside [0, V).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardcheck import REPLICATED, BadInput, Case, FuzzSpace, Layout, Property, Shard, cite, ours
from shardcheck.suites._megatron_model import (
    BATCH,
    HEADS,
    HIDDEN,
    LAYERS,
    ONE_RANK,
    SEQ,
    VOCAB,
    UnderShims,
    build_model,
    call_model,
    check_names,
    make_params,
    megatron_missing,
    megatron_shims,
    param_layouts,
    sharded_params,
)
from shardcheck.suites._model_utils_checks import outside_seed
from shardcheck.suites._model_utils_comm import merge
from shardcheck.suites._model_utils_megatron_gpt import gpt_model_case, patched_forward

FAMILY = "model_utils"
PATCH_OP = "model_utils.patch_gpt_model_forward_for_linear_ce_fusion"
FORWARD_OP = "model_utils._gpt_forward_with_linear_ce_fusion"


# ---- golden ----------------------------------------------------------------------------------------------------


def golden_logits(x: dict, tied: bool, vocab: int = VOCAB) -> torch.Tensor:
    """The unpatched single-device model's [B, S, V] logits (differentiable w.r.t. the parameter inputs). The
    golden runs before the case and outside `patched_forward`, so GPTModel.forward is Megatron's own here."""
    names = list(param_layouts(tied))
    ids = x["input_ids"]

    def fn(*params):
        model = build_model(tied, ONE_RANK, params[0].dtype, ids.device, vocab=vocab, seq=ids.shape[1])
        check_names(model, dict.fromkeys(names))
        return call_model(model, dict(zip(names, params)), ids)

    return UnderShims.apply(fn, ids.device, None, *[x[n] for n in names])


def reference_logprobs(x: dict, tied: bool, vocab: int = VOCAB) -> torch.Tensor:
    """[B, S-1]: log-softmax of the golden logits (float32 at least) at labels[:, 1:]; 0 outside [0, V)."""
    logits = golden_logits(x, tied, vocab)
    logprobs = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)[:, :-1]
    target = x["labels"][:, 1:].long()
    valid = (target >= 0) & (target < vocab)
    picked = logprobs.gather(-1, torch.where(valid, target, 0)[..., None]).squeeze(-1)
    return torch.where(valid, picked, torch.zeros_like(picked))


# ---- cases -----------------------------------------------------------------------------------------------------


def make_inputs(
    gen: torch.Generator,
    tied: bool,
    masked: float = 0.0,
    labels_are_ids: bool = False,
    vocab: int = VOCAB,
    b: int = BATCH,
    s: int = SEQ,
) -> dict[str, torch.Tensor]:
    """input_ids and labels [B, S] (labels: the unshifted ids to score, -100 where masked) and every parameter."""
    params = make_params(gen, tied, vocab)
    ids = torch.randint(0, vocab, (b, s), generator=gen)
    labels = ids.clone() if labels_are_ids else torch.randint(0, vocab, (b, s), generator=gen)
    if masked:
        labels[torch.rand((b, s), generator=gen) < masked] = -100
    return {"input_ids": ids, "labels": labels, **params}


def run_fused(
    impl, ctx, x: dict, tied: bool, chunk: int, vocab: int = VOCAB, twice: bool = False, **kwargs
) -> torch.Tensor:
    """[B, S-1] log-probs from this rank's TP-sharded model, GPTModel.forward patched by the module under test."""
    names = list(param_layouts(tied))
    tp_group = ctx.group("tp")

    def fn(ids, labels, *params):
        model = build_model(tied, tp_group, ctx.dtype, ctx.device, vocab=vocab, seq=ids.shape[1])
        local = sharded_params(model, params, names, tp_group)
        with patched_forward(impl, chunk, twice):
            return call_model(model, local, ids, labels=labels, return_logprobs_for_linear_ce_fusion=True, **kwargs)

    return UnderShims.apply(fn, ctx.device, tp_group, x["input_ids"], x["labels"], *[x[n] for n in names])


def run_flag_off(impl, ctx, x: dict, tied: bool, patched: bool = True, labels: bool = False):
    """Logits [B, S, V/TP] (or, with labels, Megatron's per-token loss [B, S]) of the patched forward with the flag
    off (patched=False: Megatron's own forward)."""
    names = list(param_layouts(tied))
    tp_group = ctx.group("tp")

    def fn(ids, lab, *params):
        model = build_model(tied, tp_group, ctx.dtype, ctx.device)
        local = sharded_params(model, params, names, tp_group)
        extra = {"labels": lab} if labels else {}
        with patched_forward(impl, 4, twice=True) if patched else contextlib.nullcontext():
            return call_model(model, local, ids, **extra)

    return UnderShims.apply(fn, ctx.device, tp_group, x["input_ids"], x["labels"], *[x[n] for n in names])


def _same_without_grad(ctx, full, local, outs, tied, chunk, vocab: int = VOCAB):
    """The fused forward under torch.no_grad (nothing saved for backward), patched twice (chunk 1, then `chunk`: the
    second call only updates the chunk size), gives the same values."""
    x = {k: v.detach() for k, v in local.items()}
    with torch.no_grad():
        again = run_fused(ctx.impl, ctx, x, tied, chunk, vocab=vocab, twice=True)
    same = torch.equal(again, outs[0].detach())
    return [
        Property(
            "no_grad_same",
            same,
            float((again - outs[0].detach()).abs().max()),
            "" if same else "torch.no_grad() after a second patch call changes the fused log-probs",
        )
    ]


def _bit_identical(ctx, full, local, outs, tied):
    """With the flag off the patched forward is Megatron's own, bit for bit: logits, and the loss given labels."""
    x = {k: v.detach() for k, v in local.items()}
    props = []
    with torch.no_grad():
        for what, labels in (("logits", False), ("loss", True)):
            got = run_flag_off(ctx.impl, ctx, x, tied, patched=True, labels=labels)
            want = run_flag_off(ctx.impl, ctx, x, tied, patched=False, labels=labels)
            same = torch.equal(got, want)
            props.append(
                Property(
                    f"bit_identical_{what}",
                    same,
                    float((got - want).abs().max()),
                    "" if same else f"flag-off {what} differ from the unpatched GPTModel.forward",
                )
            )
    return props


AG, RS, AR, A2A = "all_gather@tp", "reduce_scatter@tp", "all_reduce@tp", "all_to_all@tp"


def _decoder_comm(ctx, s: int, b: int, output_layer: bool) -> tuple[dict, dict]:
    """Megatron's sequence-parallel collectives per rank (none at TP = 1), e = the model dtype's size, full = S·B·H·e:
    forward: the embedding's reduce-scatter, per layer an all-gather before and a reduce-scatter after attention and
             the MLP (2L each), plus the output layer's all-gather when it runs;
    backward: per layer 4 all-gathers (each column-parallel input again, each row-parallel output gradient) and 2
             reduce-scatters (the column-parallel input gradients), the embedding's all-gather, the output layer's
             all-gather and reduce-scatter when it runs; and the suite's finalize_model_grads stand-in: one
             all-reduce of each sequence-parallel-tagged [H] parameter (6 per layer + the final norm's 2).
    Lower bound: sequence parallelism moves O(S·B·H) per matmul pair, independent of V."""
    tp = ctx.size("tp")
    if tp == 1:
        return {}, {}
    e = ctx.dtype.itemsize
    full = s * b * HIDDEN * e
    out = int(output_layer)
    ag_f, rs_f, ag_b, rs_b, sp_params = (
        2 * LAYERS + out,
        2 * LAYERS + 1,
        4 * LAYERS + 1 + out,
        2 * LAYERS + out,
        6 * LAYERS + 2,
    )
    fwd = {AG: (ag_f, ag_f * full // tp), RS: (rs_f, rs_f * full)}
    bwd = {AG: (ag_b, ag_b * full // tp), RS: (rs_b, rs_b * full), AR: (sp_params, sp_params * HIDDEN * e)}
    return fwd, bwd


def fused_comm(ctx, tied: bool, chunk: int, s: int = SEQ, vocab: int = VOCAB, b: int = BATCH) -> dict:
    """The fused path: Megatron's decoder (without the output layer) plus from_parallel_hidden_states_to_logprobs
    (suites/_model_utils_comm.hidden_comm; issued on the TP group at TP = 1 too): forward the all-gather of the hidden
    shards and 2c + 1 all-reduces of per-token scalars (4·B·S·e); backward the all-gather again, 2c all-reduces
    (2·B·S·e) and the hidden-state gradient's reduce-scatter as one all-to-all of [S, B, H]. Never [B, S, V]."""
    tp, e = ctx.size("tp"), torch.promote_types(ctx.dtype, torch.float32).itemsize
    c = -(-s // chunk)
    shard = s * b * HIDDEN * ctx.dtype.itemsize // tp
    fwd, bwd = _decoder_comm(ctx, s, b, output_layer=False)
    fwd = merge(fwd, {AG: (1, shard), AR: (2 * c + 1, 4 * b * s * e)})
    bwd = merge(bwd, {AG: (1, shard), AR: (2 * c, 2 * b * s * e), A2A: (1, s * b * HIDDEN * e)})
    return {"forward": fwd, "backward": bwd}


def flag_off_comm(ctx, tied: bool) -> dict:
    """The flag-off path is Megatron's own forward returning vocab-parallel logits: the decoder and the output layer."""
    fwd, bwd = _decoder_comm(ctx, SEQ, BATCH, output_layer=True)
    return {"forward": fwd, "backward": bwd}


def supports(t, seq: int = SEQ, vocab: int = VOCAB) -> bool:
    return t.dp == 1 and t.cp == 1 and seq % t.tp == 0 and vocab % t.tp == 0 and HEADS % t.tp == 0


@dataclass(frozen=True)
class FusionSpec:
    """The fused forward: tied or untied embeddings, `chunk` positions at a time (5 and 3 do not divide S = 16;
    16 is one chunk), `masked` of the labels -100, or labels equal to the input ids."""

    tied: bool
    chunk: int
    masked: float = 0.0
    labels_are_ids: bool = False
    seq: int = SEQ
    vocab: int = VOCAB
    batch: int = BATCH

    @property
    def extra(self) -> dict:
        return {
            k: x
            for k, x, default in (
                ("masked", self.masked, 0.0),
                ("labels_are_ids", self.labels_are_ids, False),
                ("S", self.seq, SEQ),
                ("V", self.vocab, VOCAB),
                ("B", self.batch, BATCH),
            )
            if x != default
        }

    @property
    def case_id(self) -> str:
        tag = "tied" if self.tied else "untied"
        return f"{tag}-chunk{self.chunk}" + "".join(f"-{k}{'' if x is True else x}" for k, x in self.extra.items())

    @property
    def params(self) -> dict:
        return {
            "tied": self.tied,
            "chunk_size": self.chunk,
            "S": SEQ,
            "B": BATCH,
            "H": HIDDEN,
            "V": VOCAB,
            **self.extra,
        }

    def inputs(self, gen: torch.Generator) -> dict[str, torch.Tensor]:
        return make_inputs(gen, self.tied, self.masked, self.labels_are_ids, self.vocab, self.batch, self.seq)

    def supports(self, t) -> bool:
        return supports(t, self.seq, self.vocab)


FUSION_SPECS = (
    FusionSpec(True, 5),
    FusionSpec(False, 5),
    FusionSpec(True, 4),
    FusionSpec(False, 16),
    FusionSpec(True, 3, masked=0.25),
    FusionSpec(False, 8, labels_are_ids=True),
)


def fused_case(spec: FusionSpec, skip: str | None) -> Case:
    """Values and every parameter gradient in float64, and the same values under torch.no_grad after a second patch."""
    return Case(
        op=PATCH_OP,
        case_id=spec.case_id,
        params=spec.params,
        make_inputs=spec.inputs,
        reference=lambda x: reference_logprobs(x, spec.tied, spec.vocab),
        run=lambda impl, ctx, x: run_fused(impl, ctx, x, spec.tied, spec.chunk, vocab=spec.vocab),
        input_layouts=param_layouts(spec.tied),
        output_layouts=(REPLICATED,),
        grad_inputs=tuple(param_layouts(spec.tied)),
        properties=lambda ctx, full, local, outs: _same_without_grad(
            ctx, full, local, outs, spec.tied, spec.chunk, spec.vocab
        ),
        comm=lambda ctx: fused_comm(ctx, spec.tied, spec.chunk, spec.seq, spec.vocab, spec.batch),
        dtypes=("float64",),
        supports=spec.supports,
        skip_reason=skip,
    )


def fused_values_case(spec: FusionSpec, skip: str | None) -> Case:
    """float32: the values (and their float32 dtype) only. Its parameter gradients differ from the float32 golden run
    by up to 0.76 of the budget (the vocab-weight gradient summed chunk by chunk vs one matmul): too close to flaky;
    the float64 cases check every gradient sharply."""
    return Case(
        op=PATCH_OP,
        case_id=f"{spec.case_id}-values",
        params=spec.params,
        make_inputs=spec.inputs,
        reference=lambda x: reference_logprobs(x, spec.tied, spec.vocab),
        run=lambda impl, ctx, x: run_fused(impl, ctx, x, spec.tied, spec.chunk, vocab=spec.vocab),
        input_layouts=param_layouts(spec.tied),
        output_layouts=(REPLICATED,),
        comm=lambda ctx: fused_comm(ctx, spec.tied, spec.chunk, spec.seq, spec.vocab, spec.batch),
        dtypes=("float32",),
        supports=spec.supports,
        skip_reason=skip,
    )


def flag_off_case(tied: bool, skip: str | None) -> Case:
    """With return_logprobs_for_linear_ce_fusion off the patched forward is Megatron's own: the vocab-parallel
    logits and bit-identical logits and loss (properties).  Every parameter's gradient of this path is the model
    case's (suites/_model_utils_megatron_gpt.py: one training step, module by module, in three dtypes)."""
    return Case(
        op=FORWARD_OP,
        case_id=f"{'tied' if tied else 'untied'}-flag-off",
        params={"tied": tied, "S": SEQ, "B": BATCH, "H": HIDDEN, "V": VOCAB},
        make_inputs=lambda gen: make_inputs(gen, tied),
        reference=lambda x: golden_logits(x, tied),
        run=lambda impl, ctx, x: run_flag_off(impl, ctx, x, tied),
        input_layouts=param_layouts(tied),
        output_layouts=(Layout(tp=Shard(-1)),),
        output_names=("logits",),
        properties=lambda ctx, full, local, outs: _bit_identical(ctx, full, local, outs, tied),
        comm=lambda ctx: flag_off_comm(ctx, tied),
        dtypes=("float64", "float32"),
        supports=supports,
        skip_reason=skip,
    )


def cases(quick: bool = False) -> list[Case]:
    skip = megatron_missing()
    specs = FUSION_SPECS[:2] if quick else FUSION_SPECS
    out = (
        [fused_case(s, skip) for s in specs]
        + [fused_values_case(s, skip) for s in specs[:2]]
        + [flag_off_case(tied, skip) for tied in ((True,) if quick else (True, False))]
        + bad_input_cases(skip)
    )
    out = cite(out, RULES, bad_input=ours(f"{DOC}#megatron-core-gptmodel-fusion"))
    for case in out:
        if case.bad_input is None:  # labels outside [0, V) are ours, as in the other model_utils suites
            case.outside_seed = outside_seed(case)
    return out + [gpt_model_case(tied) for tied in ((False,) if quick else (False, True))]


DOC = "docs/ops/model_utils.md"
# Where each property's rule comes from (docs/ops/model_utils.md#rules-seed-or-ours lists them).
RULES = {
    "property:no_grad_same": ours(f"{DOC}#megatron-core-gptmodel-fusion"),
    "property:bit_identical_*": ours(f"{DOC}#megatron-core-gptmodel-fusion"),
}


# ---- uses it does not serve ------------------------------------------------------------------------------------


def _call_with(impl, ctx, x, model_kwargs: dict | None = None, chunk: int = 4, **forward_kwargs):
    """The patched forward of a model built with `model_kwargs`, called with `forward_kwargs`."""
    names = list(param_layouts(True))
    tp_group = ctx.group("tp")
    with megatron_shims(ctx.device, tp_group):
        model = build_model(True, tp_group, ctx.dtype, ctx.device, **(model_kwargs or {}))
        local = {n: x[n] for n in names}
        with patched_forward(impl, chunk):
            kwargs = {"labels": x["labels"], "return_logprobs_for_linear_ce_fusion": True, **forward_kwargs}
            return call_model(model, local, x["input_ids"], **kwargs)


@dataclass(frozen=True)
class BadUse:
    name: str
    what: str  # the use, in words
    run: Callable
    supports: Callable = supports


BAD_USES = (
    BadUse("no-labels", "the fused forward without labels", lambda impl, ctx, x: _call_with(impl, ctx, x, labels=None)),
    BadUse(
        "loss-mask",
        "a loss_mask handed to the fused forward",
        lambda impl, ctx, x: _call_with(impl, ctx, x, loss_mask=torch.ones_like(x["labels"])),
    ),
    BadUse("chunk-size-0", "chunk_size 0", lambda impl, ctx, x: _call_with(impl, ctx, x, chunk=0)),
    BadUse(
        "tp-without-sequence-parallel",
        "TP > 1 without sequence parallelism",
        lambda impl, ctx, x: _call_with(impl, ctx, x, {"sequence_parallel": False}),
        lambda t: supports(t) and t.tp > 1,
    ),
    BadUse(
        "context-parallel",
        "a model with a CP group",
        lambda impl, ctx, x: _call_with(impl, ctx, x, {"cp_group": ctx.group("cp")}),
        lambda t: t.dp == 1 and t.tp == 1 and t.cp == 2,
    ),
)


def bad_input_cases(skip: str | None) -> list[Case]:
    """No answer is documented for these uses, so the op must raise on every rank (before any collective, or a
    peer hangs)."""
    return [
        Case(
            op=PATCH_OP,
            case_id=f"error-{use.name}",
            params={"error": use.name},
            make_inputs=lambda gen: make_inputs(gen, True),
            reference=lambda x: None,
            run=use.run,
            bad_input=BadInput(use.what),
            dtypes=("float64",),
            supports=use.supports,
            context_parallel=use.name == "context-parallel",
            skip_reason=skip,
        )
        for use in BAD_USES
    ]


# ---- benchmarks (`shardcheck run --bench`): the fused path vs logits-then-log-softmax ------------------------------
#
# The golden (`reference`) is exactly the unfused path: the unpatched model's [B, S, V] logits, then log-softmax and
# gather. At topology size 1 the worker measures both on the same inputs: peak_bytes (fused) / ref_peak_bytes
# (unfused) is the memory ratio. B = 1, S = 512, chunk 32, V = 8192 and 32768 (hidden 64: the logits dominate).


def bench_case(tied: bool, s: int, v: int, chunk: int, skip: str | None) -> Case:
    return Case(
        op=PATCH_OP,
        case_id=f"bench-{'tied' if tied else 'untied'}-b1s{s}v{v}-chunk{chunk}",
        params={"tied": tied, "B": 1, "S": s, "V": v, "H": HIDDEN, "chunk_size": chunk, "sweep": "V"},
        make_inputs=lambda gen: make_inputs(gen, tied, vocab=v, b=1, s=s),
        reference=lambda x: reference_logprobs(x, tied, vocab=v),
        run=lambda impl, ctx, x: run_fused(impl, ctx, x, tied, chunk, vocab=v),
        input_layouts=param_layouts(tied),
        grad_inputs=tuple(param_layouts(tied)),
        comm=lambda ctx: fused_comm(ctx, tied, chunk, s=s, vocab=v),
        supports=lambda t: t.size == 1,
        skip_reason=skip,
    )


def bench_cases(quick: bool = False) -> list[Case]:
    skip = megatron_missing()
    sizes = [(256, 8192, 32)] if quick else [(512, 8192, 32), (512, 32768, 32)]
    return [bench_case(tied, s, v, chunk, skip) for s, v, chunk in sizes for tied in (True, False)]


# ---- fuzz space (`shardcheck fuzz`) ------------------------------------------------------------------
#
# The fused forward: tied or untied, chunk sizes from 1 past S (a last chunk of any length), masked labels, labels
# equal to the ids, S, V and B of the model (S and V divisible by TP: Megatron's sequence parallelism and vocab
# split need it).  float64 checks values and every parameter gradient, float32 the values (as the fixed cases).
# `_gpt_forward_with_linear_ce_fusion` has no space: with the flag off it is Megatron's own forward, bit for bit,
# whatever the sizes (its fixed cases check exactly that), and with the flag on it is the patched op's path above.


def _fuzz_params(topologies):
    from hypothesis import strategies as st

    allowed = sorted(
        {t for t in topologies if supports(t, t.tp * 4, t.tp * 8)}, key=lambda t: (t.size, t.tp, t.cp, t.dp)
    )
    topology = st.sampled_from([[t.dp, t.cp, t.tp] for t in allowed]) if allowed else st.nothing()

    @st.composite
    def params(draw):
        dp, cp, tp = draw(topology)
        seq = tp * draw(st.integers(-(-2 // tp), 12 // tp + 1))  # S ≥ 2: one next-token log-prob at least
        return {
            "topology": [dp, cp, tp],
            "dtype": draw(st.sampled_from(["float64", "float32"])),
            "tied": draw(st.booleans()),
            "S": seq,
            "V": tp * draw(st.integers(2, 40 // tp)),
            "B": draw(st.integers(1, 2)),
            "chunk_size": draw(st.integers(1, seq + 2)),
            "masked": draw(st.sampled_from([0.0, 0.25, 0.9])),
            "labels_are_ids": draw(st.booleans()),
        }

    return params()


def _fuzz_case(p: dict) -> Case:
    spec = FusionSpec(p["tied"], p["chunk_size"], p["masked"], p["labels_are_ids"], p["S"], p["V"], p["B"])
    return (fused_case if p["dtype"] == "float64" else fused_values_case)(spec, megatron_missing())


def fuzz_spaces() -> list[FuzzSpace]:
    return [FuzzSpace(PATCH_OP, _fuzz_params, _fuzz_case)]
