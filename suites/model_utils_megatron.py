"""Suite for the Megatron-Core linear-CE fusion of model_utils (seed 001): `patch_gpt_model_forward_for_linear_ce_fusion`
and `_gpt_forward_with_linear_ce_fusion`, on a tiny Megatron-Core GPTModel (2 layers, hidden 64, 4 heads, vocab 128,
S 16, RoPE, local layer spec), tied and untied embeddings, TP 1, 2, 4 (sequence parallel at TP > 1).

Needs the optional extra `pip install -e .[megatron]`; without megatron-core every case is recorded `skip` with the
reason. Only (dp, cp) = (1, 1) topologies (and cp = 2 for the case checking that CP is refused): the model's TP group is the mesh's "tp" group, handed to Megatron through a
`ProcessGroupCollection` (Megatron's global parallel_state is never initialised, so a tp2 topology inside a 4-rank
launch is fine: spare ranks wait, as for any case).

How the model enters: every parameter of the *single-device* model (TP = 1) is a case input named by its parameter
name (`decoder.layers.0.mlp.linear_fc1.weight`, ...), with its TP layout: column-parallel weights/biases and the
embedding / output weights `Shard(0)`, row-parallel weights `Shard(1)`, norms and row-parallel biases replicated. Each
rank runs its TP-sharded GPTModel with `torch.func.functional_call` on its local pieces, so the gradient of every
parameter lands on the harness's local input and is compared, on every rank, with its slice of the golden gradient.
Replicated parameters used on a sequence shard (norms, row-parallel biases: Megatron tags them `sequence_parallel`)
get partial gradients; the case sums them over TP as Megatron's finalize_model_grads does (harness.case.GradSum).

Golden (`reference`): the unpatched single-device model's logits -> log-softmax in float64 (float32 for lower
precisions) -> gathered at the shifted labels; 0 where a label is outside [0, V).

Megatron-Core on CPU needs a few shims; they live in `megatron_shims()` below and nowhere else, and are applied only
while a Megatron case runs its forward and its backward (`_UnderShims` runs the model's graph inside them, both ways).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
from functools import partial

import torch
from torch.distributed.tensor import Shard

from harness.case import REPLICATED, BadInput, Case, GradSum, Layout, Property

FAMILY = "model_utils"
PATCH_OP = "model_utils.patch_gpt_model_forward_for_linear_ce_fusion"
FORWARD_OP = "model_utils._gpt_forward_with_linear_ce_fusion"

LAYERS, HIDDEN, HEADS, FFN, VOCAB, SEQ, BATCH = 2, 64, 4, 256, 128, 16, 2
COLUMN, ROW = Layout(tp=Shard(0)), Layout(tp=Shard(1))  # column-parallel (and vocab) rows; row-parallel columns


def megatron_missing() -> str | None:
    """Why the Megatron cases cannot run here, or None."""
    try:
        found = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else "megatron-core is not installed (pip install -e .[megatron])"


# ---- shims: the one place Megatron-Core is adapted to CPU + gloo -------------------------------------------------


@contextlib.contextmanager
def megatron_shims(device: torch.device, tp_group=None):
    """What Megatron-Core needs to run a GPTModel on CPU, set for the duration of the block and restored after:
    - the CUDA RNG tracker is Megatron's no-op one (its fork() does nothing; seeding is torch.manual_seed's);
    - on CPU, `torch.cuda.current_device` answers the CPU device (Megatron allocates its sequence-parallel
      all-gather / reduce-scatter buffers there);
    - Megatron's global memory buffer exists (attention and sequence-parallel gathers take scratch from it);
    - `parallel_state`'s TP group is `tp_group` (the unpatched loss path, `vocab_parallel_cross_entropy`, reads the
      global TP group instead of the model's pg_collection).
    Megatron's parallel_state is otherwise never initialised; the model gets its groups from a ProcessGroupCollection."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as megatron_random

    saved_tracker = (megatron_random._CUDA_RNG_STATE_TRACKER, megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED)
    saved_buffer, saved_tp = parallel_state._GLOBAL_MEMORY_BUFFER, parallel_state._TENSOR_MODEL_PARALLEL_GROUP
    saved_current_device = torch.cuda.current_device
    try:
        megatron_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        if saved_buffer is None:
            parallel_state._set_global_memory_buffer()
        if tp_group is not None:
            parallel_state._TENSOR_MODEL_PARALLEL_GROUP = tp_group
        if device.type == "cpu":
            torch.cuda.current_device = lambda: torch.device("cpu")
        yield
    finally:
        torch.cuda.current_device = saved_current_device
        parallel_state._GLOBAL_MEMORY_BUFFER, parallel_state._TENSOR_MODEL_PARALLEL_GROUP = saved_buffer, saved_tp
        megatron_random._CUDA_RNG_STATE_TRACKER, megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = saved_tracker


class _UnderShims(torch.autograd.Function):
    """fn(*tensors) -> tensor or tuple of tensors, run as a nested graph inside megatron_shims(), forward and
    backward (the harness runs the backward after the case returns, outside any block the case could open)."""

    @staticmethod
    def forward(ctx, fn, device, tp_group, *tensors):
        inner = [t.detach().requires_grad_(t.is_floating_point() and ctx.needs_input_grad[3 + i])
                 for i, t in enumerate(tensors)]
        with torch.enable_grad(), megatron_shims(device, tp_group):
            outs = fn(*inner)
        outs = outs if isinstance(outs, tuple) else (outs,)
        ctx.inner, ctx.outs, ctx.device, ctx.tp_group = inner, outs, device, tp_group
        return tuple(o.detach().clone() for o in outs) if len(outs) > 1 else outs[0].detach().clone()

    @staticmethod
    def backward(ctx, *grads):
        wanted = [t for t in ctx.inner if t.requires_grad]
        pairs = [(o, g) for o, g in zip(ctx.outs, grads) if g is not None and o.requires_grad]
        with megatron_shims(ctx.device, ctx.tp_group):
            got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True))
        return (None, None, None, *[next(got) if t.requires_grad else None for t in ctx.inner])


class _OneRankGroup:
    """The single-device golden model's process groups: at size 1 Megatron issues no collective, it only asks
    size() and rank()."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


ONE_RANK = _OneRankGroup()


class _SequenceParallelNorm:
    """Megatron's torch LayerNorm refuses config.sequence_parallel; build it with SP off and tag its parameters
    `sequence_parallel` (their gradients are partial sums over the sequence shards), as Megatron's own norms do.
    A class whose __new__ returns the norm, like WrappedTorchNorm (Megatron's build_module instantiates classes)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = WrappedTorchNorm(plain, hidden_size, eps)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel
        return norm


# ---- the model -------------------------------------------------------------------------------------------------


def param_layouts(tied: bool) -> dict[str, Layout]:
    """Every parameter of the tiny GPTModel and its TP layout (replicated ones: REPLICATED)."""
    layouts = {"embedding.word_embeddings.weight": COLUMN}
    for i in range(LAYERS):
        pre = f"decoder.layers.{i}."
        layouts.update({
            pre + "input_layernorm.weight": REPLICATED, pre + "input_layernorm.bias": REPLICATED,
            pre + "self_attention.linear_proj.weight": ROW, pre + "self_attention.linear_proj.bias": REPLICATED,
            pre + "self_attention.linear_qkv.weight": COLUMN, pre + "self_attention.linear_qkv.bias": COLUMN,
            pre + "pre_mlp_layernorm.weight": REPLICATED, pre + "pre_mlp_layernorm.bias": REPLICATED,
            pre + "mlp.linear_fc1.weight": COLUMN, pre + "mlp.linear_fc1.bias": COLUMN,
            pre + "mlp.linear_fc2.weight": ROW, pre + "mlp.linear_fc2.bias": REPLICATED,
        })
    layouts.update({"decoder.final_layernorm.weight": REPLICATED, "decoder.final_layernorm.bias": REPLICATED})
    if not tied:
        layouts["output_layer.weight"] = COLUMN
    return layouts


def _full_shape(name: str, vocab: int) -> tuple[int, ...]:
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return (vocab, HIDDEN)
    kind = name.split(".")[-2] if name.startswith("decoder.layers.") else "norm"
    width = {"linear_qkv": 3 * HIDDEN, "linear_fc1": FFN}.get(kind, HIDDEN)
    if name.endswith(".bias") or "layernorm" in name:
        return (width,)
    return (width, FFN if kind == "linear_fc2" else HIDDEN)


def make_params(gen: torch.Generator, tied: bool, vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    """Full float64 parameters: weights N(0, 1/fan_in), norms 1 + N(0, 0.2²), biases N(0, 0.1²); the embedding
    N(0, 0.4²) and the output weight N(0, 9/H), so logits are ~N(0, 3²) either way."""
    params = {}
    for name in param_layouts(tied):
        shape = _full_shape(name, vocab)
        noise = torch.randn(shape, generator=gen, dtype=torch.float64)
        if name == "embedding.word_embeddings.weight":
            params[name] = noise * 0.4
        elif name == "output_layer.weight":
            params[name] = noise * (3.0 / HIDDEN ** 0.5)
        elif "layernorm.weight" in name:
            params[name] = 1.0 + 0.2 * noise
        elif name.endswith(".bias"):
            params[name] = 0.1 * noise
        else:
            params[name] = noise / shape[1] ** 0.5
    return params


_MODELS: dict[tuple, torch.nn.Module] = {}


def build_model(tied: bool, tp_group, dtype: torch.dtype, device: torch.device, sequence_parallel: bool | None = None,
                vocab: int = VOCAB, seq: int = SEQ, cp_group=None):
    """The tiny GPTModel, TP-sharded over `tp_group` (sequence parallel at TP > 1 unless told otherwise); its own
    parameter values are never used (the cases pass theirs through functional_call). `cp_group`: a CP group for the
    model's pg_collection (only to check that the fusion refuses CP). Cached per process."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp = tp_group.size()
    sp = tp > 1 if sequence_parallel is None else sequence_parallel
    key = (tied, id(tp_group), tp, dtype, device, sp, vocab, seq, id(cp_group))
    if key in _MODELS:
        return _MODELS[key]
    one = ONE_RANK
    groups = ProcessGroupCollection()
    groups.tp = groups.tp_cp = groups.tp_ep = groups.tp_ep_pp = groups.mp = tp_group
    groups.cp = cp_group if cp_group is not None else one
    groups.pp = groups.ep = groups.expt_tp = groups.dp = groups.dp_cp = groups.expt_dp = one
    groups.embd = groups.pos_embd = None
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=FFN,
        tensor_model_parallel_size=tp, sequence_parallel=sp, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False)
    layer = get_gpt_layer_local_spec()
    layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = _SequenceParallelNorm
    spec = TransformerBlockSubmodules(layer_specs=[layer] * LAYERS, layer_norm=_SequenceParallelNorm)
    with megatron_shims(device):
        model = GPTModel(config, spec, vocab_size=vocab, max_sequence_length=seq, position_embedding_type="rope",
                         share_embeddings_and_output_weights=tied, pg_collection=groups).to(device=device, dtype=dtype)
    _MODELS[key] = model
    return model


def _model_args(ids: torch.Tensor) -> tuple:
    """(input_ids, position_ids, attention_mask): Megatron's boolean causal mask, True = masked."""
    b, s = ids.shape
    positions = torch.arange(s, device=ids.device)[None].expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=ids.device), diagonal=1)[None, None]
    return ids, positions, mask


def _call(model, params: dict, ids: torch.Tensor, **kwargs):
    return torch.func.functional_call(model, params, _model_args(ids), kwargs)


def _check_names(model, params: dict) -> None:
    names = [n for n, _ in model.named_parameters()]
    if sorted(names) != sorted(params):
        raise ValueError(f"GPTModel parameters {sorted(set(names) ^ set(params))} differ from the suite's table")


def _sharded_params(model, x: dict, names, tp_group) -> dict:
    """This rank's pieces, the sequence-parallel-tagged ones summed over TP in backward (GradSum)."""
    own = dict(model.named_parameters())
    _check_names(model, dict.fromkeys(names))
    summed = tp_group.size() > 1
    return {n: GradSum.apply(t, (tp_group,)) if summed and getattr(own[n], "sequence_parallel", False) else t
            for n, t in zip(names, x)}


@contextlib.contextmanager
def _patched(impl, chunk_size: int, twice: bool = False):
    """GPTModel.forward patched by the module under test for the block, then restored (other cases see the original).
    `twice`: patched first with chunk_size 1, then with `chunk_size` (the second call must only update it)."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    original = GPTModel.forward
    try:
        if twice:
            impl.patch_gpt_model_forward_for_linear_ce_fusion(chunk_size=1)
        impl.patch_gpt_model_forward_for_linear_ce_fusion(chunk_size=chunk_size)
        yield original
    finally:
        GPTModel.forward = original


# ---- golden ----------------------------------------------------------------------------------------------------


def _golden_logits(x: dict, tied: bool, vocab: int = VOCAB) -> torch.Tensor:
    """The unpatched single-device model's [B, S, V] logits (differentiable w.r.t. the parameter inputs). The
    golden runs before the case and outside `_patched`, so GPTModel.forward is Megatron's own here."""
    names = list(param_layouts(tied))
    ids = x["input_ids"]

    def fn(*params):
        model = build_model(tied, ONE_RANK, params[0].dtype, ids.device, vocab=vocab, seq=ids.shape[1])
        _check_names(model, dict.fromkeys(names))
        return _call(model, dict(zip(names, params)), ids)

    return _UnderShims.apply(fn, ids.device, None, *[x[n] for n in names])


def reference_logprobs(x: dict, tied: bool, vocab: int = VOCAB) -> torch.Tensor:
    """[B, S-1]: log-softmax of the golden logits (float32 at least) at labels[:, 1:]; 0 outside [0, V)."""
    logits = _golden_logits(x, tied, vocab)
    logprobs = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)[:, :-1]
    target = x["labels"][:, 1:].long()
    valid = (target >= 0) & (target < vocab)
    picked = logprobs.gather(-1, torch.where(valid, target, 0)[..., None]).squeeze(-1)
    return torch.where(valid, picked, torch.zeros_like(picked))


# ---- cases -----------------------------------------------------------------------------------------------------


def make_inputs(gen: torch.Generator, tied: bool, masked: float = 0.0, labels_are_ids: bool = False,
                vocab: int = VOCAB, b: int = BATCH, s: int = SEQ) -> dict[str, torch.Tensor]:
    """input_ids and labels [B, S] (labels: the unshifted ids to score, -100 where masked) and every parameter."""
    params = make_params(gen, tied, vocab)
    ids = torch.randint(0, vocab, (b, s), generator=gen)
    labels = ids.clone() if labels_are_ids else torch.randint(0, vocab, (b, s), generator=gen)
    if masked:
        labels[torch.rand((b, s), generator=gen) < masked] = -100
    return {"input_ids": ids, "labels": labels, **params}


def run_fused(impl, ctx, x: dict, tied: bool, chunk: int, vocab: int = VOCAB, twice: bool = False,
              **kwargs) -> torch.Tensor:
    """[B, S-1] log-probs from this rank's TP-sharded model, GPTModel.forward patched by the module under test."""
    names = list(param_layouts(tied))
    tp_group = ctx.group("tp")

    def fn(ids, labels, *params):
        model = build_model(tied, tp_group, ctx.dtype, ctx.device, vocab=vocab, seq=ids.shape[1])
        local = _sharded_params(model, params, names, tp_group)
        with _patched(impl, chunk, twice):
            return _call(model, local, ids, labels=labels, return_logprobs_for_linear_ce_fusion=True, **kwargs)

    return _UnderShims.apply(fn, ctx.device, tp_group, x["input_ids"], x["labels"], *[x[n] for n in names])


def _run_flag_off(impl, ctx, x: dict, tied: bool, patched: bool = True, labels: bool = False):
    """Logits [B, S, V/TP] (or, with labels, Megatron's per-token loss [B, S]) of the patched forward with the flag
    off (patched=False: Megatron's own forward)."""
    names = list(param_layouts(tied))
    tp_group = ctx.group("tp")

    def fn(ids, lab, *params):
        model = build_model(tied, tp_group, ctx.dtype, ctx.device)
        local = _sharded_params(model, params, names, tp_group)
        extra = {"labels": lab} if labels else {}
        with _patched(impl, 4, twice=True) if patched else contextlib.nullcontext():
            return _call(model, local, ids, **extra)

    return _UnderShims.apply(fn, ctx.device, tp_group, x["input_ids"], x["labels"], *[x[n] for n in names])


def _same_without_grad(ctx, full, local, outs, tied, chunk):
    """The fused forward under torch.no_grad (nothing saved for backward), patched twice (chunk 1, then `chunk`: the
    second call only updates the chunk size), gives the same values."""
    x = {k: v.detach() for k, v in local.items()}
    with torch.no_grad():
        again = run_fused(ctx.impl, ctx, x, tied, chunk, twice=True)
    same = torch.equal(again, outs[0].detach())
    return [Property("no_grad_same", same, float((again - outs[0].detach()).abs().max()),
                     "" if same else "torch.no_grad() after a second patch call changes the fused log-probs")]


def _bit_identical(ctx, full, local, outs, tied):
    """With the flag off the patched forward is Megatron's own, bit for bit: logits, and the loss given labels."""
    x = {k: v.detach() for k, v in local.items()}
    props = []
    with torch.no_grad():
        for what, labels in (("logits", False), ("loss", True)):
            got = _run_flag_off(ctx.impl, ctx, x, tied, patched=True, labels=labels)
            want = _run_flag_off(ctx.impl, ctx, x, tied, patched=False, labels=labels)
            same = torch.equal(got, want)
            props.append(Property(f"bit_identical_{what}", same, float((got - want).abs().max()),
                                  "" if same else f"flag-off {what} differ from the unpatched GPTModel.forward"))
    return props


AG, RS, AR, A2A = "all_gather@tp", "reduce_scatter@tp", "all_reduce@tp", "all_to_all@tp"


def _merge(*phases: dict) -> dict:
    out: dict = {}
    for phase in phases:
        for key, (calls, nbytes) in phase.items():
            out[key] = (out.get(key, (0, 0))[0] + calls, out.get(key, (0, 0))[1] + nbytes)
    return out


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
    ag_f, rs_f, ag_b, rs_b, sp_params = 2 * LAYERS + out, 2 * LAYERS + 1, 4 * LAYERS + 1 + out, 2 * LAYERS + out, 6 * LAYERS + 2
    fwd = {AG: (ag_f, ag_f * full // tp), RS: (rs_f, rs_f * full)}
    bwd = {AG: (ag_b, ag_b * full // tp), RS: (rs_b, rs_b * full), AR: (sp_params, sp_params * HIDDEN * e)}
    return fwd, bwd


def fused_comm(ctx, tied: bool, chunk: int, s: int = SEQ, vocab: int = VOCAB, b: int = BATCH) -> dict:
    """The fused path: Megatron's decoder (without the output layer) plus from_parallel_hidden_states_to_logprobs
    (suites/model_utils.hidden_comm; issued on the TP group at TP = 1 too): forward the all-gather of the hidden
    shards and 2c + 1 all-reduces of per-token scalars (4·B·S·e); backward the all-gather again, 2c all-reduces
    (2·B·S·e) and the hidden-state gradient's reduce-scatter as one all-to-all of [S, B, H]. Never [B, S, V]."""
    tp, e = ctx.size("tp"), torch.promote_types(ctx.dtype, torch.float32).itemsize
    c = -(-s // chunk)
    shard = s * b * HIDDEN * ctx.dtype.itemsize // tp
    fwd, bwd = _decoder_comm(ctx, s, b, output_layer=False)
    fwd = _merge(fwd, {AG: (1, shard), AR: (2 * c + 1, 4 * b * s * e)})
    bwd = _merge(bwd, {AG: (1, shard), AR: (2 * c, 2 * b * s * e), A2A: (1, s * b * HIDDEN * e)})
    return {"forward": fwd, "backward": bwd}


def flag_off_comm(ctx, tied: bool) -> dict:
    """The flag-off path is Megatron's own forward returning vocab-parallel logits: the decoder and the output layer."""
    fwd, bwd = _decoder_comm(ctx, SEQ, BATCH, output_layer=True)
    return {"forward": fwd, "backward": bwd}


def _supports(t, seq: int = SEQ, vocab: int = VOCAB) -> bool:
    return t.dp == 1 and t.cp == 1 and seq % t.tp == 0 and vocab % t.tp == 0 and HEADS % t.tp == 0


def _param_grad_inputs(tied: bool) -> tuple[str, ...]:
    return tuple(param_layouts(tied))


def cases(quick: bool = False) -> list[Case]:
    skip = megatron_missing()
    # (tied, chunk, extra): chunk 5 and 3 do not divide S = 16; 16 is one chunk.
    specs = [(True, 5, {}), (False, 5, {}), (True, 4, {}), (False, 16, {}), (True, 3, {"masked": 0.25}),
             (False, 8, {"labels_are_ids": True})]
    if quick:
        specs = specs[:2]
    out = []
    for tied, chunk, extra in specs:
        tag = "tied" if tied else "untied"
        out.append(Case(
            op=PATCH_OP, case_id=f"{tag}-chunk{chunk}" + "".join(f"-{k}{'' if v is True else v}" for k, v in extra.items()),
            params={"tied": tied, "chunk_size": chunk, "S": SEQ, "B": BATCH, "H": HIDDEN, "V": VOCAB, **extra},
            make_inputs=partial(make_inputs, tied=tied, **extra),
            reference=partial(reference_logprobs, tied=tied),
            run=partial(run_fused, tied=tied, chunk=chunk),
            input_layouts=param_layouts(tied), output_layouts=(REPLICATED,), grad_inputs=_param_grad_inputs(tied),
            properties=partial(_same_without_grad, tied=tied, chunk=chunk),
            comm=partial(fused_comm, tied=tied, chunk=chunk), dtypes=("float64",), supports=_supports,
            skip_reason=skip))
    # float32: the values (and their float32 dtype) only. Its parameter gradients differ from the float32 golden run
    # by up to 0.76 of the budget (the vocab-weight gradient summed chunk by chunk vs one matmul): too close to flaky;
    # the float64 cases above check every gradient sharply.
    for tied, chunk, extra in specs[:2]:
        tag = "tied" if tied else "untied"
        out.append(Case(
            op=PATCH_OP, case_id=f"{tag}-chunk{chunk}-values",
            params={"tied": tied, "chunk_size": chunk, "S": SEQ, "B": BATCH, "H": HIDDEN, "V": VOCAB, **extra},
            make_inputs=partial(make_inputs, tied=tied, **extra), reference=partial(reference_logprobs, tied=tied),
            run=partial(run_fused, tied=tied, chunk=chunk), input_layouts=param_layouts(tied),
            output_layouts=(REPLICATED,), comm=partial(fused_comm, tied=tied, chunk=chunk), dtypes=("float32",),
            supports=_supports, skip_reason=skip))
    for tied in ((True, False) if not quick else (True,)):
        tag = "tied" if tied else "untied"
        out.append(Case(
            op=FORWARD_OP, case_id=f"{tag}-flag-off",
            params={"tied": tied, "S": SEQ, "B": BATCH, "H": HIDDEN, "V": VOCAB},
            make_inputs=partial(make_inputs, tied=tied),
            reference=partial(_golden_logits, tied=tied),
            run=partial(_run_flag_off, tied=tied),
            input_layouts=param_layouts(tied), output_layouts=(Layout(tp=Shard(-1)),), output_names=("logits",),
            grad_inputs=_param_grad_inputs(tied), properties=partial(_bit_identical, tied=tied),
            comm=partial(flag_off_comm, tied=tied), dtypes=("float64", "float32"), supports=_supports,
            skip_reason=skip))
    out += error_cases(skip)
    return out


def _call_with(impl, ctx, x, model_kwargs: dict | None = None, chunk: int = 4, **forward_kwargs):
    """The patched forward of a model built with `model_kwargs`, called with `forward_kwargs` (the error cases)."""
    names = list(param_layouts(True))
    tp_group = ctx.group("tp")
    with megatron_shims(ctx.device, tp_group):
        model = build_model(True, tp_group, ctx.dtype, ctx.device, **(model_kwargs or {}))
        local = {n: x[n] for n in names}
        with _patched(impl, chunk):
            kwargs = {"labels": x["labels"], "return_logprobs_for_linear_ce_fusion": True, **forward_kwargs}
            return _call(model, local, x["input_ids"], **kwargs)


def error_cases(skip: str | None) -> list[Case]:
    """Uses of the fused forward it does not serve: no answer is documented for them, so the op must raise on
    every rank (before any collective, or a peer hangs)."""
    specs = [
        ("no-labels", "the fused forward without labels", lambda impl, ctx, x: _call_with(impl, ctx, x, labels=None),
         _supports),
        ("loss-mask", "a loss_mask handed to the fused forward",
         lambda impl, ctx, x: _call_with(impl, ctx, x, loss_mask=torch.ones_like(x["labels"])), _supports),
        ("chunk-size-0", "chunk_size 0", lambda impl, ctx, x: _call_with(impl, ctx, x, chunk=0), _supports),
        ("tp-without-sequence-parallel", "TP > 1 without sequence parallelism",
         lambda impl, ctx, x: _call_with(impl, ctx, x, {"sequence_parallel": False}),
         lambda t: _supports(t) and t.tp > 1),
        ("context-parallel", "a model with a CP group",
         lambda impl, ctx, x: _call_with(impl, ctx, x, {"cp_group": ctx.group("cp")}),
         lambda t: t.dp == 1 and t.tp == 1 and t.cp == 2),
    ]
    return [Case(op=PATCH_OP, case_id=f"error-{name}", params={"error": name}, make_inputs=partial(make_inputs, tied=True),
                 reference=lambda x: None, run=run, bad_input=BadInput(what), dtypes=("float64",), supports=supports,
                 context_parallel=name == "context-parallel", skip_reason=skip)
            for name, what, run, supports in specs]


# ---- benchmarks (`shardcheck run --bench`): the fused path vs logits-then-log-softmax ------------------------------
#
# The golden (`reference`) is exactly the unfused path: the unpatched model's [B, S, V] logits, then log-softmax and
# gather. At topology size 1 the worker measures both on the same inputs: peak_bytes (fused) / ref_peak_bytes
# (unfused) is the memory ratio. B = 1, S = 512, chunk 32, V = 8192 and 32768 (hidden 64: the logits dominate).


def bench_cases(quick: bool = False) -> list[Case]:
    skip = megatron_missing()
    sizes = [(256, 8192, 32)] if quick else [(512, 8192, 32), (512, 32768, 32)]
    out = []
    for s, v, chunk in sizes:
        for tied in (True, False):
            tag = "tied" if tied else "untied"
            out.append(Case(
                op=PATCH_OP, case_id=f"bench-{tag}-b1s{s}v{v}-chunk{chunk}",
                params={"tied": tied, "B": 1, "S": s, "V": v, "H": HIDDEN, "chunk_size": chunk, "sweep": "V"},
                make_inputs=partial(make_inputs, tied=tied, vocab=v, b=1, s=s),
                reference=partial(reference_logprobs, tied=tied, vocab=v),
                run=partial(run_fused, tied=tied, chunk=chunk, vocab=v),
                input_layouts=param_layouts(tied), grad_inputs=_param_grad_inputs(tied),
                comm=partial(fused_comm, tied=tied, chunk=chunk, s=s, vocab=v), supports=lambda t: t.size == 1,
                skip_reason=skip))
    return out
