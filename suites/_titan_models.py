"""titan suite: torchtitan's own models under torchtitan's own `model.parallelize(parallel_dims)`.

The model is torchtitan's (Llama 3: `Llama3Model`; Qwen3-MoE: `Qwen3Model` with MoE layers) from a tiny config built
with torchtitan's own layer builders, random weights; the plan is torchtitan's sharding config, filled by
`Config.update_from_config` from a `ParallelismConfig` and applied by `model.parallelize(ParallelDims(...))`, the
forward inside `get_spmd_context(parallel_dims=...)`.  Needs the optional extra `pip install -e .[titan]`; without
it every case is recorded `skip` with the reason.  On CPU torchtitan needs shardcheck's shims `triton_import` and
`titan_device` (harness/rank/shims/, installed by the rank), and, here, three adaptations of the configuration (not
of the plan):
- attention: torchtitan's language models accept only flex or varlen attention, and FlexAttention has no CPU
  backward: every layer's inner attention is torchtitan's `ScaledDotProductAttention` (causal, no mask);
- RoPE: Llama 3's complex RoPE cache is a buffer that `Module.to(float32)` turns real (the harness casts the model
  to each item's dtype): a forward pre-hook recomputes it where it is not complex;
- FSDP: the dp = 1 cases apply `model.parallelize` alone (TP / SP / EP); the FSDP cases torchtitan's whole
  parallelize function (`parallelize_llama`, `parallelize_qwen3`: FSDP2 / HSDP after it), its mixed-precision
  parameter dtype the item's (torchtitan's default is bfloat16 parameters over float32 masters).

Topology -> torchtitan's degrees (`degrees`): tensor_parallel_degree = tp, data_parallel_shard_degree = dp /
dp_replicate, data_parallel_replicate_degree = dp_replicate, context_parallel_degree = cp, expert_parallel_degree =
dp_shard x cp x tp where the case is expert-parallel (EP over the FSDP and TP ranks, efsdp 1; ep == tp at dp 1, cp 1).
torchtitan builds its own DeviceMesh over the world (`ParallelDims.build_mesh`), so the cases run only in a launch of
exactly their size (`world_group`); its mesh dims are not dp/cp/tp, so its DTensors are gathered and judged whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from shardcheck.suites import _routing as routing

VOCAB, DIM, LAYERS, HEADS, BATCH, SEQ = 32, 16, 2, 4, 4, 8  # BATCH: every DP size up to 4; MLP hidden 2 x DIM
EXPERTS, TOP_K = 4, 2  # each expert's hidden dim DIM
MOE_MODELS = ("qwen3_moe",)
DTYPES = ("float64", "float32", "bfloat16")
COMPUTE_DTYPE = torch.float32  # torchtitan's RoPE computes in float32: a float64 item gets float32's budgets
# Under FSDP torchtitan takes its parameter dtype by name from TORCH_DTYPE_MAP (training.mixed_precision_param), which
# has no float64: its FSDP (and CP, reduced by FSDP) layouts run in float32 and bfloat16.
FSDP_DTYPES = ("float32", "bfloat16")
HEAD_DIM = DIM // HEADS


@dataclass(frozen=True)
class Arch:
    """What a tiny config keeps of a model: its head counts (dim = heads x HEAD_DIM, MLP hidden 2 x dim, each expert's
    hidden dim), experts and top-k, RoPE.  The default is the suite's own; a user's job config gives its own
    (suites/_titan_config.py)."""

    heads: int = HEADS
    kv_heads: int = HEADS
    experts: int = EXPERTS
    top_k: int = TOP_K
    rope: object = None  # a torchtitan RoPE config (its dim and max_seq_len set here); None: the suite's

    @property
    def dim(self) -> int:
        return self.heads * HEAD_DIM

    def rope_config(self, default):
        if self.rope is None:
            return default
        return dataclasses.replace(self.rope, dim=HEAD_DIM, max_seq_len=SEQ)


ARCH = Arch()


def titan_missing() -> str | None:
    """Why the torchtitan cases cannot run here, or None."""
    if importlib.util.find_spec("torchtitan") is None:
        return "torchtitan is not installed (pip install -e .[titan])"
    return None


@dataclass(frozen=True)
class Degrees:
    """torchtitan's ParallelismConfig degrees of one topology."""

    tp: int
    dp_shard: int
    ep: int
    dp_replicate: int = 1
    cp: int = 1


def degrees(topology, expert_parallel: bool) -> Degrees:
    """Expert-parallel cases put EP on every rank of the data-sharded (FSDP: dp_shard x cp) and TP dims (ep = dp_shard
    x cp x tp, efsdp 1: torchtitan's EP borrowed from FSDP and TP); at dp 1, cp 1 that is ep == tp."""
    dp_shard = topology.dp // topology.dp_replicate
    ep = dp_shard * topology.cp * topology.tp if expert_parallel else 1
    return Degrees(tp=topology.tp, dp_shard=dp_shard, ep=ep, dp_replicate=topology.dp_replicate, cp=topology.cp)


def parallelism(d: Degrees, sequence_parallel: bool, backend: str):
    from torchtitan.config import ParallelismConfig

    return ParallelismConfig(
        tensor_parallel_degree=d.tp,
        data_parallel_shard_degree=d.dp_shard,
        data_parallel_replicate_degree=d.dp_replicate,
        expert_parallel_degree=d.ep,
        context_parallel_degree=d.cp,
        enable_sequence_parallel=sequence_parallel,
        spmd_backend=backend,
    )


# ---- the tiny configs --------------------------------------------------------------------------------------------


def _sdpa_attention(config) -> None:
    from torchtitan.models.common import ScaledDotProductAttention

    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()


def llama3_config(arch: Arch = ARCH, layers: int = LAYERS):
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

    dim = arch.dim
    config = Llama3Model.Config(
        dim=dim,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim),
        norm=RMSNorm.Config(normalized_shape=dim),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB),
        layers=_build_llama3_layers(
            n_layers=layers,
            dim=dim,
            n_heads=arch.heads,
            n_kv_heads=arch.kv_heads,
            hidden_dim=2 * dim,
            rope=arch.rope_config(ComplexRoPE.Config(dim=HEAD_DIM, max_seq_len=SEQ, theta=10000.0, scaling="none")),
            attn_backend="flex",
        ),
    )
    _sdpa_attention(config)
    return config


def qwen3_moe_config(arch: Arch = ARCH, layers: int = LAYERS):
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_moe_layers, _qwen3_norm

    dim = arch.dim
    config = Qwen3Model.Config(
        vocab_size=VOCAB,
        dim=dim,
        norm=_qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB),
        layers=_build_qwen3_moe_layers(
            n_layers=layers,
            dim=dim,
            n_heads=arch.heads,
            n_kv_heads=arch.kv_heads,
            head_dim=HEAD_DIM,
            moe_hidden_dim=dim,
            num_experts=arch.experts,
            top_k=arch.top_k,
            attn_backend="flex",
            rope=arch.rope_config(CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=SEQ, theta=10000.0)),
            moe_comm_backend="standard",
        ),
    )
    _sdpa_attention(config)
    return config


CONFIGS = {"llama3": llama3_config, "qwen3_moe": qwen3_moe_config}


def configured(model: str, d: Degrees, sequence_parallel: bool, backend: str, arch: Arch = ARCH):
    config = CONFIGS[model](arch)
    config.update_from_config(config=SimpleNamespace(parallelism=parallelism(d, sequence_parallel, backend)))
    return config


def _complex_rope(module: torch.nn.Module, args) -> None:
    """Recompute a complex RoPE cache that a dtype cast turned real (Module.to casts complex buffers too)."""
    from torchtitan.models.common import ComplexRoPE

    for m in module.modules():
        if isinstance(m, ComplexRoPE) and not m.cache.is_complex():
            with torch.device(m.cache.device), default_dtype(torch.float64):  # as at build: the same cache
                m.cache = m._precompute_cache()


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


@contextlib.contextmanager
def spmd_backend(backend: str):
    """torchtitan's process-wide SPMD backend (its trainer sets it from the ParallelismConfig), restored after."""
    from torchtitan.distributed import utils as dist_utils

    saved = dist_utils.get_spmd_backend()
    dist_utils.set_spmd_backend(backend)
    try:
        yield
    finally:
        dist_utils.set_spmd_backend(saved)


def instantiate(config) -> torch.nn.Module:
    """torchtitan's build and init, in float64 (the harness casts the model to each item's dtype)."""
    with default_dtype(torch.float64):
        model = config.build()
        model.init_states()
    model.register_forward_pre_hook(_complex_rope)
    return model


def fill_weights(model: torch.nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for _, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            p.copy_(1 + 0.1 * noise if p.dim() == 1 else noise / math.sqrt(p.shape[-1]))


def build(model: str, arch: Arch = ARCH, margin: bool = True):
    """`margin`: the MoE routers redrawn for a routing margin (a user's 128 experts, top 8, find none: no bfloat16)."""

    def full_model(gen: torch.Generator) -> torch.nn.Module:
        net = instantiate(configured(model, Degrees(1, 1, 1), False, "spmd_types", arch))
        fill_weights(net, gen)
        if margin and model in MOE_MODELS:  # every token routes with a margin: no dtype flips a top-k (_routing.py)
            redraws = torch.Generator().manual_seed(int(torch.randint(2**62, (), generator=gen)))
            tokens = make_inputs(routing.peek(gen))["tokens"]
            routing.widen_routing(lambda: net(tokens), gates(net), arch.top_k, redraws)
        return net

    return full_model


def gates(net: torch.nn.Module) -> list[torch.nn.Module]:
    """The MoE layers' router gates (`moe.router.gate`, a Linear: logits = x @ weight.T), first layer first."""
    return [m for name, m in net.named_modules() if name.endswith("moe.router.gate")]


def make_inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}


def make_inputs_with_positions(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The batch and each token's position in its sequence, as torchtitan's dataloader hands them to its trainer:
    under CP its `prepare_context_parallel_input` shards all three head-tail over cp, so RoPE reads each rank's
    tokens' global positions."""
    inputs = make_inputs(gen)
    return inputs | {"positions": torch.arange(SEQ).expand(BATCH, SEQ).contiguous()}


def loss(logits, inputs: dict, ctx) -> torch.Tensor:
    """Next-token cross-entropy in float32 at least, torchtitan's trainer's way: this rank's token sum over the global
    token count (its summand of the global mean; FSDP over dp x cp sums the gradients, `loss_layout=Layout(dp=Partial(),
    cp=Partial())`).
    Vocab-sharded logits made whole (a DTensor's own placements; spmd_types' plain local shard: its vocabulary slice
    over TP, gathered with DTensor so the backward slices)."""
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    elif ctx is not None and logits.shape[-1] != VOCAB:
        logits = DTensor.from_local(logits, ctx.mesh["tp"], [Shard(logits.dim() - 1)]).full_tensor()
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    labels = inputs["labels"].flatten()
    ranks = 1 if ctx is None else ctx.size("dp") * ctx.size("cp")  # each rank's piece of the batch
    return F.cross_entropy(logits.flatten(0, 1), labels, reduction="sum") / (labels.numel() * ranks)


# ---- the plan ----------------------------------------------------------------------------------------------------


def declared_layouts(model: torch.nn.Module) -> dict:
    """{parameter name: Layout} of every parameter whose module's torchtitan sharding config places it over TP, read
    from the plan itself (`_sharding_config.state_shardings`): what a plain local shard is under the spmd_types
    backend, whose parameters are not DTensors.  Expert weights under EP (the ep axis) are Shard(0) over the TP
    ranks, where the cases put EP."""
    import spmd_types as spmd
    from torch.distributed.tensor import Shard

    from shardcheck import Layout

    layouts = {}
    for path, module in model.named_modules():
        config = getattr(module, "_sharding_config", None)
        for name, layout in (getattr(config, "state_shardings", None) or {}).items():
            placement = next(
                (t for axis, t in layout.axis_types.items() if str(axis) in ("tp", "ep") and isinstance(t, spmd.Shard)),
                None,
            )
            if placement is not None:
                layouts[f"{path}.{name}" if path else name] = Layout(tp=Shard(placement.dim))
    return layouts


def whole_parallelize(name: str, model: torch.nn.Module, dims, parallelism_config) -> None:
    """torchtitan's own parallelize function of the model (its trainer's call): TP / EP by `model.parallelize`, then
    FSDP2 over the data dims (`apply_fsdp_to_decoder`: HSDP where dp_replicate > 1), gradient division off (its
    loss is each rank's token sum over the global token count).  No activation checkpointing, no compile; FSDP's
    mixed-precision parameter dtype is the item's (the harness casts the model), reductions in float32 at least."""
    from torchtitan.config import CompileConfig, TrainingConfig

    dtype = next(model.parameters()).dtype
    reduce = torch.promote_types(dtype, torch.float32)
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float64: "float64"}
    training = TrainingConfig(mixed_precision_param=names[dtype], mixed_precision_reduce=names[reduce])
    PARALLELIZE[name]()(
        model,
        parallel_dims=dims,
        training=training,
        parallelism=parallelism_config,
        compile_config=CompileConfig(enable=False, components=[]),
        ac_config=None,
        dump_folder="",
    )


def _parallelize_llama():
    from torchtitan.models.llama3 import parallelize_llama

    return parallelize_llama


def _parallelize_qwen3():
    from torchtitan.models.qwen3 import parallelize_qwen3

    return parallelize_qwen3


PARALLELIZE = {"llama3": _parallelize_llama, "qwen3_moe": _parallelize_qwen3}


class Plan:
    """torchtitan's plan for one case: the model rebuilt with the topology's sharding config (the harness's weights
    go in after), then `model.parallelize(parallel_dims)`; `step_context` enters torchtitan's SPMD context."""

    def __init__(
        self,
        model: str,
        expert_parallel: bool,
        sequence_parallel: bool,
        backend: str,
        edit=None,
        data_parallel: bool = False,
        arch: Arch = ARCH,
    ):
        self.model, self.expert_parallel, self.arch = model, expert_parallel, arch
        self.sequence_parallel, self.backend, self.edit = sequence_parallel, backend, edit
        # torchtitan's whole parallelize function (TP/EP, then FSDP / HSDP over the data dims), not the TP part alone
        self.data_parallel = data_parallel
        self.parallel_dims = None
        # the ModelCase's param_layouts: filled from the plan's own sharding configs once it is applied (plain local
        # parameters under spmd_types; DTensor parameters need none)
        self.layouts: dict = {}

    def __call__(self, full: torch.nn.Module, ctx) -> torch.nn.Module:
        from torchtitan.distributed import ParallelDims

        d = degrees(ctx.topology, self.expert_parallel)
        config = configured(self.model, d, self.sequence_parallel, self.backend, self.arch)
        if self.edit is not None:
            self.edit(config)
        model = instantiate(config).to(next(full.parameters()).dtype)
        _complex_rope(model, ())  # before parallelize distributes the cache
        dims = ParallelDims(
            dp_replicate=d.dp_replicate,
            dp_shard=d.dp_shard,
            cp=d.cp,
            tp=d.tp,
            pp=1,
            ep=d.ep,
            world_size=ctx.topology.size,
            spmd_backend=self.backend,
        )
        dims.build_mesh()
        with spmd_backend(self.backend):
            if self.data_parallel:
                whole_parallelize(self.model, model, dims, parallelism(d, self.sequence_parallel, self.backend))
            else:
                model.parallelize(dims)
        self.parallel_dims = dims
        self.layouts.clear()
        self.layouts.update(declared_layouts(model))
        return model

    def step_context(self, ctx):
        """torchtitan's SPMD backend on both sides, and on a rank its SPMD context over the plan's ParallelDims."""
        from torchtitan.distributed import utils as dist_utils

        stack = contextlib.ExitStack()
        stack.enter_context(spmd_backend(self.backend))
        if ctx is not None and self.parallel_dims is not None:
            stack.enter_context(dist_utils.get_spmd_context(parallel_dims=self.parallel_dims)())
        return stack
