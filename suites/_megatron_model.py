"""model_utils_megatron suite: the tiny Megatron-Core GPTModel the fusion cases run, and what it needs on CPU.

2 layers, hidden 64, 4 heads, vocab 128, S 16, RoPE, local layer spec, tied or untied embeddings, TP 1, 2, 4
(sequence parallel at TP > 1).  Every parameter of the single-device model is a case input named by its parameter
name, with its TP layout (`param_layouts`); each rank runs its TP-sharded model with `torch.func.functional_call`
on its local pieces (`call_model`).  Megatron-Core on CPU needs a few shims: they live in `megatron_shims()` and
nowhere else, applied only while a case runs its forward and its backward (`UnderShims`).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import warnings

import torch

from shardcheck import REPLICATED, GradSum, Layout, Shard

LAYERS, HIDDEN, HEADS, FFN, VOCAB, SEQ, BATCH = 2, 64, 4, 256, 128, 16, 2
COLUMN, ROW = Layout(tp=Shard(0)), Layout(tp=Shard(1))  # column-parallel (and vocab) rows; row-parallel columns

# Megatron-Core warns, on import and when a model is built, that Apex and Transformer Engine are absent and that a
# config default is deprecated: facts of a CPU install, not findings.  The driver builds the single-device model when
# it loads the suite (a model case's check names come from one step), so they would print in every run's output.
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core")


def megatron_missing() -> str | None:
    """Why the Megatron cases cannot run here, or None."""
    try:
        found = (
            importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
        )
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
    - where torch.distributed is not initialised (the driver, listing a model case, runs its single-device model
      once), Megatron's `get_tensor_model_parallel_group_if_none` passes the group it is given through instead of
      answering None (its groups are then ONE_RANK: size 1, no collective).
    Megatron's parallel_state is otherwise never initialised; the model gets its groups from a
    ProcessGroupCollection."""
    import sys

    from megatron.core import parallel_state
    from megatron.core import utils as megatron_utils
    from megatron.core.tensor_parallel import random as megatron_random

    group_if_none = megatron_utils.get_tensor_model_parallel_group_if_none
    users = (
        []
        if torch.distributed.is_initialized()
        else [
            m
            for name, m in list(sys.modules.items())
            if name.startswith("megatron.core")
            and getattr(m, "get_tensor_model_parallel_group_if_none", None) is group_if_none
        ]
    )

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
        for m in users:
            m.get_tensor_model_parallel_group_if_none = _group_as_given
        yield
    finally:
        for m in users:
            m.get_tensor_model_parallel_group_if_none = group_if_none
        torch.cuda.current_device = saved_current_device
        parallel_state._GLOBAL_MEMORY_BUFFER, parallel_state._TENSOR_MODEL_PARALLEL_GROUP = saved_buffer, saved_tp
        megatron_random._CUDA_RNG_STATE_TRACKER, megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = saved_tracker


def _group_as_given(tp_group, is_expert: bool = False, check_initialized: bool = True):
    return tp_group


class UnderShims(torch.autograd.Function):
    """fn(*tensors) -> tensor or tuple of tensors, run as a nested graph inside megatron_shims(), forward and
    backward (the harness runs the backward after the case returns, outside any block the case could open)."""

    @staticmethod
    def forward(ctx, fn, device, tp_group, *tensors):
        inner = [
            t.detach().requires_grad_(t.is_floating_point() and ctx.needs_input_grad[3 + i])
            for i, t in enumerate(tensors)
        ]
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


class OneRankGroup:
    """The single-device golden model's process groups: at size 1 Megatron issues no collective, it only asks
    size() and rank()."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


ONE_RANK = OneRankGroup()


class SequenceParallelNorm:
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
        layouts.update(
            {
                pre + "input_layernorm.weight": REPLICATED,
                pre + "input_layernorm.bias": REPLICATED,
                pre + "self_attention.linear_proj.weight": ROW,
                pre + "self_attention.linear_proj.bias": REPLICATED,
                pre + "self_attention.linear_qkv.weight": COLUMN,
                pre + "self_attention.linear_qkv.bias": COLUMN,
                pre + "pre_mlp_layernorm.weight": REPLICATED,
                pre + "pre_mlp_layernorm.bias": REPLICATED,
                pre + "mlp.linear_fc1.weight": COLUMN,
                pre + "mlp.linear_fc1.bias": COLUMN,
                pre + "mlp.linear_fc2.weight": ROW,
                pre + "mlp.linear_fc2.bias": REPLICATED,
            }
        )
    layouts.update({"decoder.final_layernorm.weight": REPLICATED, "decoder.final_layernorm.bias": REPLICATED})
    if not tied:
        layouts["output_layer.weight"] = COLUMN
    return layouts


def full_shape(name: str, vocab: int) -> tuple[int, ...]:
    """The single-device shape of parameter `name`."""
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
        shape = full_shape(name, vocab)
        noise = torch.randn(shape, generator=gen, dtype=torch.float64)
        if name == "embedding.word_embeddings.weight":
            params[name] = noise * 0.4
        elif name == "output_layer.weight":
            params[name] = noise * (3.0 / HIDDEN**0.5)
        elif "layernorm.weight" in name:
            params[name] = 1.0 + 0.2 * noise
        elif name.endswith(".bias"):
            params[name] = 0.1 * noise
        else:
            params[name] = noise / shape[1] ** 0.5
    return params


_MODELS: dict[tuple, torch.nn.Module] = {}


def build_model(
    tied: bool,
    tp_group,
    dtype: torch.dtype,
    device: torch.device,
    sequence_parallel: bool | None = None,
    vocab: int = VOCAB,
    seq: int = SEQ,
    cp_group=None,
    cache: bool = True,
):
    """The tiny GPTModel, TP-sharded over `tp_group` (sequence parallel at TP > 1 unless told otherwise); the op
    cases never use its own parameter values (they pass theirs through functional_call). `cp_group`: a CP group for
    the model's pg_collection (only to check that the fusion refuses CP). Cached per process unless `cache` is off
    (the model case trains its model: a fresh one each time)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp = tp_group.size()
    sp = tp > 1 if sequence_parallel is None else sequence_parallel
    key = (tied, id(tp_group), tp, dtype, device, sp, vocab, seq, id(cp_group))
    if cache and key in _MODELS:
        return _MODELS[key]
    one = ONE_RANK
    groups = ProcessGroupCollection()
    groups.tp = groups.tp_cp = groups.tp_ep = groups.tp_ep_pp = groups.mp = tp_group
    groups.cp = cp_group if cp_group is not None else one
    groups.pp = groups.ep = groups.expt_tp = groups.dp = groups.dp_cp = groups.expt_dp = one
    groups.embd = groups.pos_embd = None
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=FFN,
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
    )
    layer = get_gpt_layer_local_spec()
    layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = SequenceParallelNorm
    spec = TransformerBlockSubmodules(layer_specs=[layer] * LAYERS, layer_norm=SequenceParallelNorm)
    with megatron_shims(device):
        model = GPTModel(
            config,
            spec,
            vocab_size=vocab,
            max_sequence_length=seq,
            position_embedding_type="rope",
            share_embeddings_and_output_weights=tied,
            pg_collection=groups,
        ).to(device=device, dtype=dtype)
    if cache:
        _MODELS[key] = model
    return model


def model_args(ids: torch.Tensor) -> tuple:
    """(input_ids, position_ids, attention_mask): Megatron's boolean causal mask, True = masked."""
    b, s = ids.shape
    positions = torch.arange(s, device=ids.device)[None].expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=ids.device), diagonal=1)[None, None]
    return ids, positions, mask


def call_model(model, params: dict, ids: torch.Tensor, **kwargs):
    """model's forward on input ids with `params` in place of its own (torch.func.functional_call)."""
    return torch.func.functional_call(model, params, model_args(ids), kwargs)


def check_names(model, params: dict) -> None:
    """ValueError unless the model's parameters are exactly the suite's table (a Megatron version that renamed one)."""
    names = [n for n, _ in model.named_parameters()]
    if sorted(names) != sorted(params):
        raise ValueError(f"GPTModel parameters {sorted(set(names) ^ set(params))} differ from the suite's table")


def sharded_params(model, x: dict, names, tp_group) -> dict:
    """This rank's pieces, the sequence-parallel-tagged ones summed over TP in backward (GradSum)."""
    own = dict(model.named_parameters())
    check_names(model, dict.fromkeys(names))
    summed = tp_group.size() > 1
    return {
        n: GradSum.apply(t, (tp_group,)) if summed and getattr(own[n], "sequence_parallel", False) else t
        for n, t in zip(names, x)
    }
