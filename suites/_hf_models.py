"""hf suite: Hugging Face Transformers' own models under their own tensor- and expert-parallel plans.

The model is Transformers' class (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM) built
from a tiny config with random weights; the plan is the one `from_pretrained(...,
distributed_config=DistributedConfig(...))` applies: `PreTrainedModel.maybe_distribute_model` (Transformers'
`base_model_tp_plan` / `base_model_ep_plan`, the model's `_tp_plan` for the head), called here on meshes cut from the
harness's (dp, cp, tp) mesh rather than on the world (a topology may run on part of a launch).  Needs the optional
extra `pip install -e .[hf]`; without it every case is recorded `skip` with the reason.

Topology -> Transformers' degrees (`degrees`): tp_size = tp, fsdp_size = dp / dp_replicate, dp_replicate_size =
the topology's dp_replicate (HSDP), ep_size where the case is expert-parallel by `ExpertRanks`: = tp (Transformers' "ep
== tp" layout, efsdp = fsdp), = fsdp at tp 1 (EP borrowed from FSDP: efsdp 1), or = fsdp x tp (EP over the whole dp x
tp: efsdp 1), cp always 1.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from enum import Enum

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from shardcheck.suites import _routing as routing

BATCH, SEQ = 4, 8  # BATCH: every DP size up to 4
EXPERTS = 4  # the MoE configs' experts: every EP size up to 4 holds at least one
DTYPES = ("float64", "float32", "bfloat16")
MOE_MODELS = ("qwen3_moe", "mixtral")
# a MoE model whose routers have no margin (a user's config, suites/_model_config.py): bfloat16 would flip a top-k
MOE_DTYPES = ("float64", "float32")
# The built-in MoE models' routers route with a margin (widen_routing), so bfloat16 flips no top-k.  Mixtral's router
# hands the experts float32 routing weights whatever the model's dtype (no cast back, unlike Qwen3-MoE's router), so a
# float64 step is float32-accurate from its first MoE layer on: its float64 items get float32's budgets
# (ModelCase.compute_dtype; as torchtitan's RoPE, suites/titan.py).
COMPUTE_DTYPES = {"mixtral": torch.float32}


def hf_missing() -> str | None:
    """Why the Transformers cases cannot run here, or None."""
    for module in ("transformers", "accelerate"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (pip install -e .[hf])"
    return None


class ExpertRanks(Enum):
    """The ranks an expert-parallel case spreads its experts over (Transformers' ep_size; efsdp = fsdp x tp / ep)."""

    TP = "tp"  # ep == tp: efsdp == fsdp, the experts FSDP-sharded as the dense layers are
    DP = "dp"  # ep == fsdp at tp 1, EP borrowed from FSDP: efsdp 1, every expert whole on one rank
    DP_TP = "dp x tp"  # ep == fsdp x tp: efsdp 1, the all-to-all over the whole dp x tp
    EP_AXIS = "ep"  # ep == the topology's ep, part of dp (tp 1; `--topology dp=4,ep=2`): efsdp = the harness's edp


@dataclass(frozen=True)
class Degrees:
    """Transformers' DistributedConfig degrees of one topology."""

    tp: int
    fsdp: int
    ep: int
    dp_replicate: int = 1


def degrees(topology, expert_parallel: bool, ep_ranks: ExpertRanks = ExpertRanks.TP) -> Degrees:
    """The topology -> parallel degrees mapping: TP on the mesh's tp dim, FSDP on dp (HSDP: dp_replicate x fsdp, shard
    innermost), EP (when the case uses it) on the ranks `ep_ranks` names."""
    fsdp = topology.dp // topology.dp_replicate
    ep = {
        ExpertRanks.TP: topology.tp,
        ExpertRanks.DP: fsdp,
        ExpertRanks.DP_TP: fsdp * topology.tp,
        ExpertRanks.EP_AXIS: topology.ep,
    }[ep_ranks]
    return Degrees(tp=topology.tp, fsdp=fsdp, ep=ep if expert_parallel else 1, dp_replicate=topology.dp_replicate)


# ---- the tiny configs --------------------------------------------------------------------------------------------

COMMON = dict(
    vocab_size=32,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=SEQ,
    tie_word_embeddings=False,
    attn_implementation="sdpa",
)


def config(model: str, layers: int | None = None):
    """The tiny config of `model` ("llama", "qwen2", "qwen3_moe", "mixtral")."""
    import transformers

    kw = dict(COMMON)
    attn = kw.pop("attn_implementation")
    if layers is not None:
        kw["num_hidden_layers"] = layers
    if model == "llama":
        cfg = transformers.LlamaConfig(**kw)
    elif model == "qwen2":
        cfg = transformers.Qwen2Config(**kw)
    elif model == "qwen3_moe":
        # 4 experts of 16, top 2: every EP size up to 4 holds at least one expert; decoder_sparse_step 1: every
        # layer is MoE; "eager" experts: the grouped matmul has no float64 on CPU
        cfg = transformers.Qwen3MoeConfig(
            **kw,
            head_dim=4,
            num_experts=EXPERTS,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            decoder_sparse_step=1,
        )
        cfg._experts_implementation = "eager"
    elif model == "mixtral":
        # the same experts as qwen3_moe's: 4 of 16 (Mixtral's experts take intermediate_size), top 2, every layer MoE
        kw["intermediate_size"] = 16
        cfg = transformers.MixtralConfig(**kw, num_local_experts=EXPERTS, num_experts_per_tok=2)
        cfg._experts_implementation = "eager"
    else:
        raise ValueError(f"unknown Transformers model {model!r}")
    cfg._attn_implementation = attn
    return cfg


def build(model: str):
    def full_model(gen: torch.Generator) -> torch.nn.Module:
        """The single-device model in float64, weights from `gen` (norm weights near 1, others ~1/sqrt(fan-in))."""
        import transformers

        cfg = config(model)
        net = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float64)
        fill_weights(net, gen)
        if model in MOE_MODELS:  # every token routes with a margin: no dtype flips a top-k (suites/_routing.py)
            redraws = torch.Generator().manual_seed(int(torch.randint(2**62, (), generator=gen)))
            tokens = make_inputs(routing.peek(gen))["input_ids"]
            routing.widen_routing(lambda: net(input_ids=tokens), routers(net), net.config.num_experts_per_tok, redraws)
        return net

    return full_model


def routers(net: torch.nn.Module) -> list[torch.nn.Module]:
    """The MoE layers' routers (`mlp.gate`: logits = x @ weight.T), first layer first."""
    return [m for name, m in net.named_modules() if name.endswith("mlp.gate")]


def fill_weights(net: torch.nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for _, p in net.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            p.copy_(1 + 0.1 * noise if p.dim() == 1 else noise / math.sqrt(p.shape[-1]))


def make_inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, COMMON["vocab_size"], (BATCH, SEQ + 1), generator=gen)
    return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}


def loss(out, inputs: dict, ctx) -> torch.Tensor:
    """Mean next-token cross-entropy over the batch this rank sees (the whole batch without DP), in float32 at least.
    The head's plan gathers the logits ("colwise_gather_output"); a DTensor is made whole."""
    logits = out.logits
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.flatten(0, 1), inputs["labels"].flatten())


# ---- the plan ----------------------------------------------------------------------------------------------------


def meshes(ctx, d: Degrees, ep_ranks: ExpertRanks = ExpertRanks.TP):
    """Transformers' mesh manager on this topology's ranks: the dense mesh (pp, dp_replicate, fsdp, tp) and the
    expert mesh (pp, dp_replicate, efsdp, ep) (`ExpertRanks`), made of the harness's own groups
    (`DeviceMesh.from_group`: no collective, so spare ranks of a larger launch are not waited for; cp is 1, so its group
    is this rank alone).  HSDP: the replicate and shard groups of `ctx.data_mesh()`.  EP over dp x tp: a group of those
    ranks (`expert_group`)."""
    from torch.distributed.device_mesh import DeviceMesh
    from transformers.distributed.utils import TransformersDeviceMesh

    one, tp_group = ctx.group("cp"), ctx.group("tp")
    replicate, shard = one, ctx.group("dp")
    if d.dp_replicate > 1:
        data = ctx.data_mesh()
        replicate, shard = data["dp_replicate"].get_group(), data["dp_shard"].get_group()
    ranks = ctx.mesh.mesh.reshape(1, d.dp_replicate, d.fsdp, d.tp)
    kind = ctx.device.type
    names = ("pp", "dp_replicate", "fsdp", "tp")
    dense = DeviceMesh.from_group([one, replicate, shard, tp_group], kind, mesh=ranks, mesh_dim_names=names)
    expert_groups, expert_ranks = [one, replicate, shard, tp_group], ranks
    if ep_ranks is ExpertRanks.DP:
        expert_groups, expert_ranks = [one, replicate, one, shard], ranks.reshape(1, d.dp_replicate, 1, d.fsdp)
    elif ep_ranks is ExpertRanks.EP_AXIS:  # the harness's (edp, ep) split of dp, ep innermost as Transformers'
        expert_ranks = ranks.reshape(1, 1, d.fsdp // d.ep, d.ep)
        expert_groups = [one, one, ctx.group("edp"), ctx.group("ep")]
    elif ep_ranks is ExpertRanks.DP_TP:
        expert_ranks = ranks.reshape(1, d.dp_replicate, 1, d.fsdp * d.tp)
        expert_groups = [one, replicate, one, expert_group(expert_ranks.reshape(d.dp_replicate, -1))]
    names = ("pp", "dp_replicate", "efsdp", "ep")
    expert = DeviceMesh.from_group(expert_groups, kind, mesh=expert_ranks, mesh_dim_names=names)
    return TransformersDeviceMesh(dense, expert)


_EXPERT_GROUPS: dict[
    tuple[int, ...], dist.ProcessGroup
] = {}  # this rank's EP group over dp x tp, made once per rank set


def expert_group(rows: torch.Tensor) -> dist.ProcessGroup:
    """A process group over the row of `rows` ([dp_replicate, fsdp x tp] global ranks) holding this rank: made by
    those ranks alone (`use_local_synchronization`: the rest of the world, spare ranks of a larger launch and the
    other replicas, is not waited for), once per rank set."""
    me = dist.get_rank()
    row = next(tuple(r.tolist()) for r in rows if me in r.tolist())
    if row not in _EXPERT_GROUPS:
        _EXPERT_GROUPS[row] = dist.new_group(list(row), use_local_synchronization=True)
    return _EXPERT_GROUPS[row]


def parallelize(
    expert_parallel: bool, ep_implementation: str = "auto", before=None, ep_ranks: ExpertRanks = ExpertRanks.TP
):
    def plan(model: torch.nn.Module, ctx) -> torch.nn.Module:
        """Transformers' own plan at this topology's degrees, as from_pretrained applies it after init."""
        from transformers.distributed.configuration_utils import DistributedConfig

        if before is not None:
            before()

        d = degrees(ctx.topology, expert_parallel, ep_ranks)
        kw = {"ep_size": d.ep, "ep_implementation": ep_implementation} if d.ep > 1 else {}
        cfg = DistributedConfig(tp_size=d.tp, fsdp_size=d.fsdp, dp_replicate_size=d.dp_replicate, **kw)
        if d.tp * d.fsdp * d.dp_replicate == 1:
            return model
        return type(model).maybe_distribute_model(model, cfg, meshes(ctx, d, ep_ranks))

    return plan
