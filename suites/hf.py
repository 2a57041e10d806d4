"""hf suite: Hugging Face Transformers' Llama, Qwen2, Qwen3-MoE and Mixtral under Transformers' own parallel plans.

One training step of each model (tiny random config: 2 layers, hidden 16, 4 heads, vocab 32, batch 4, sequence 8;
suites/_hf_models.py) under the plan `from_pretrained(..., distributed_config=DistributedConfig(tp_size=...,
ep_size=...))` applies, against the same model on one device, module by module (docs/model-cases.md), in float64,
float32 and bfloat16 at world sizes 1, 2, 4:

- `llama-tp`, `qwen2-tp`, `qwen3_moe-tp`: Transformers' tensor-parallel plan (`base_model_tp_plan`; the MoE experts
  by `moe_tp_experts`), tp = the topology's tp;
- `qwen3_moe-ep`: the expert-parallel plan (`base_model_ep_plan`, `ep_dispatch_experts`) on the TP ranks, ep == tp,
  with the dense layers under TP; tokens exchanged by all-to-all (Transformers' default in training);
- `llama-fsdp-tp`, `qwen3_moe-fsdp-ep`, `mixtral-fsdp-tp`, `mixtral-fsdp-ep`: the same plans with FSDP over dp
  (fsdp_size = dp, 2 or 4; HSDP at `--topology dp=4,dp_replicate=2`: dp_replicate_size x fsdp_size), each rank's
  loss the mean of its rows and gradients averaged, as Transformers trains (`loss_layout=Layout(dp=Partial("avg"))`);
- `qwen3_moe-fsdp-ep-from-dp`: EP borrowed from FSDP (tp 1, ep == fsdp, efsdp 1): in float64 torch 2.13's FSDP2
  divides the experts' gradients twice, a `KnownFailure` (FSDP2_DOUBLE_DIVIDE);
- `qwen3_moe-fsdp-ep-part-of-dp`: EP on part of the dp ranks, the topology's ep axis (`--topology dp=4,ep=2`: ep 2,
  efsdp 2, tp 1);
- `qwen3_moe-fsdp-ep-over-dp-tp`: EP over the whole dp x tp (dp 2 x tp 2: ep 4, efsdp 1), the dense layers under
  FSDP and TP; the same double division in float64;
- `qwen3_moe-ep-allreduce`: the same plan with `ep_implementation="all_reduce"` (each rank runs its experts on the
  shared batch, outputs summed; the router weights' gradient summed over EP in the backward);
- `mixtral-tp`, `mixtral-ep`: Mixtral under the same two plans (its experts as Qwen3-MoE's: 4 of 16, top 2): its
  router hands the experts float32 routing weights whatever the model's dtype, so a float64 step is float32-accurate
  and judged with float32's budgets (`COMPUTE_DTYPES`).

A router's top-k is a discrete choice: two correct runs that round differently (the sharded one and the single-device
one, in bfloat16) could send a token to different experts.  The MoE models' routers are drawn so that every token of
the case's inputs routes with a margin (`_hf_models.widen_routing`), so the MoE cases run in bfloat16 too.

Inside the experts the activation function is called once per local expert: under TP its output is split by columns
(declared), under EP the k-th call is another expert on each rank and under FSDP each dp rank's own tokens, so it is
not compared there; the experts' output, and every gradient, is.

Needs the optional extra `pip install -e .[hf]`; without it every case is recorded `skip` with the reason.
Third-party models: docs/third-party-models.md.
"""

from __future__ import annotations

from dataclasses import replace

from shardcheck import KnownFailure, Layout, ModelCase, Partial, Shard
from shardcheck.suites import _hf_models as hf
from shardcheck.suites._hf_models import ExpertRanks

FAMILY = "hf"
IMPLEMENTATION = __file__
# Minutes of a run on CPU ranks, and an optional extra: run when named (--suite, --op), not by a plain `shardcheck run`.
RUN_BY_DEFAULT = False
HEADS = hf.COMMON["num_attention_heads"]


def parallelize(model, ctx):
    """Transformers' own plan (the op every case names; the plans are hf.parallelize's)."""
    return hf.parallelize(expert_parallel=False)(model, ctx)


def _with_dp(t) -> bool:
    """FSDP over dp (2 or 4; HSDP where the case says so and dp is split) with or without TP; no CP."""
    return t.dp > 1 and t.cp == 1 and HEADS % t.tp == 0 and hf.BATCH % t.dp == 0


def _ep_from_dp(t) -> bool:
    """EP borrowed from FSDP: ep == fsdp over dp (2 or 4; under HSDP the shard group's dp / dp_replicate, at least 2),
    tp 1 (efsdp 1: each expert whole on one rank)."""
    return _with_dp(t) and t.tp == 1 and t.dp // t.dp_replicate > 1


def _ep_over_dp_tp(t) -> bool:
    """EP over the whole dp x tp (both > 1; tp 1 is `_ep_from_dp`), ep dividing the experts: dp 2 x tp 2."""
    return _with_dp(t) and t.tp > 1 and hf.EXPERTS % (t.dp * t.tp) == 0


def _ep_part_of_dp(t) -> bool:
    """EP on the topology's ep axis, part of dp (1 < ep < dp; ep == dp is `_ep_from_dp`), tp 1: dp 4, ep 2."""
    return _with_dp(t) and t.tp == 1 and 1 < t.ep < t.dp


SUPPORTS_WITH_DP = {
    ExpertRanks.TP: _with_dp,
    ExpertRanks.DP: _ep_from_dp,
    ExpertRanks.DP_TP: _ep_over_dp_tp,
    ExpertRanks.EP_AXIS: _ep_part_of_dp,
}


def _tp_only(t) -> bool:
    """TP at any size dividing the heads; no DP (Transformers averages gradients over FSDP), no CP."""
    return t.dp == 1 and t.cp == 1 and HEADS % t.tp == 0


EXPERT_ACT = "*.mlp.experts.act_fn"


def case(
    model: str,
    expert_parallel: bool = False,
    case_id: str | None = None,
    ep_implementation: str = "auto",
    before=None,
    fsdp: bool = False,
    ep_ranks: ExpertRanks = ExpertRanks.TP,
    xfail: KnownFailure | None = None,
    hsdp: bool = False,
) -> ModelCase:
    """`before()`: run on the rank before the plan (a broken plan registers its EP implementation there).  `fsdp`:
    the data-parallel layouts (FSDP over dp, each rank's loss the mean of its rows, gradients averaged), `hsdp` also
    at the topologies that split dp replicate x shard; `ep_ranks`: the ranks EP spans (with `fsdp`: the dp ones at tp
    1, or the whole dp x tp)."""
    batch = {"input_ids": Layout(dp=Shard(0)), "labels": Layout(dp=Shard(0))}
    supports = SUPPORTS_WITH_DP[ep_ranks] if fsdp else _tp_only
    # The k-th call of an expert's activation holds the tokens routed to it on this rank: under EP another expert on
    # each rank, under FSDP (TP experts too) each dp rank's own tokens, in neither a split of the single device's rows.
    experts_unmapped = expert_parallel or (fsdp and model in hf.MOE_MODELS)
    return ModelCase(
        op=f"{FAMILY}.parallelize",
        case_id=case_id or f"{model}-{'ep' if expert_parallel else 'tp'}",
        build=hf.build(model),
        parallelize=hf.parallelize(expert_parallel, ep_implementation, before, ep_ranks),
        make_inputs=hf.make_inputs,
        model_inputs=("input_ids",),
        loss=hf.loss,
        activation_layouts={} if experts_unmapped else {EXPERT_ACT: Layout(tp=Shard(-1))},
        unchecked_modules=(EXPERT_ACT,) if experts_unmapped else (),
        supports=supports,
        input_layouts=batch if fsdp else {},
        loss_layout=Layout(dp=Partial("avg")) if fsdp else Layout(),
        dtypes=hf.DTYPES,
        compute_dtype=hf.COMPUTE_DTYPES.get(model),
        skip_reason=hf.hf_missing(),
        xfail=xfail,
        hsdp=hsdp,
        expert_parallel=ep_ranks is ExpertRanks.EP_AXIS,  # runs the topologies with ep > 1 (`dp=4,ep=2`)
        params={"model": model, "expert_parallel": expert_parallel, "ep_ranks": ep_ranks.value, "experts": hf.EXPERTS},
    )


# torch 2.13's FSDP2 on its SUM path (a float64 reduce dtype) with an explicit divide factor and a reduce-scatter group
# of one rank divides twice: Transformers sets the experts' factor to dp and, with EP borrowed from FSDP, their efsdp
# group is one rank, so the experts' gradients come out halved (quartered at dp 4) in float64.  float32 and bfloat16
# take the PREMUL_SUM path, which divides once.
FSDP2_DOUBLE_DIVIDE = KnownFailure(
    reason="torch 2.13 FSDP2 divides the experts' gradients twice (float64 SUM path, 1-rank efsdp group)",
    reference="tests/fixtures/upstream/fsdp2_double_divide.py; docs/third-party-models.md",
    checks=("forward:dparam:*.mlp.experts.*", "forward:step:*.mlp.experts.*"),
    when=lambda topology, dtype: dtype == "float64",
)
# The same with EP on the TP ranks (ep == tp, efsdp == fsdp) under HSDP with one rank per shard group (dp ==
# dp_replicate, e.g. dp=2,tp=2,dp_replicate=2): the experts' efsdp group is one rank, FSDP2 divides before its
# replicate all-reduce and again after it.  At tp 1 the case has no EP and Transformers sets no divide factor.
FSDP2_DOUBLE_DIVIDE_HSDP = replace(
    FSDP2_DOUBLE_DIVIDE, when=lambda t, dtype: dtype == "float64" and t.tp > 1 and t.dp == t.dp_replicate
)


def cases(quick: bool = False) -> list[ModelCase]:
    if quick:  # one model under one plan (the default run's --quick, the bench runs of every suite)
        return [case("llama")]
    return [
        case("llama"),
        case("qwen2"),
        case("qwen3_moe"),
        case("qwen3_moe", expert_parallel=True),
        case("qwen3_moe", expert_parallel=True, case_id="qwen3_moe-ep-allreduce", ep_implementation="all_reduce"),
        case("mixtral"),
        case("mixtral", expert_parallel=True),
        case("llama", case_id="llama-fsdp-tp", fsdp=True, hsdp=True),
        case(
            "qwen3_moe",
            expert_parallel=True,
            case_id="qwen3_moe-fsdp-ep",
            fsdp=True,
            hsdp=True,
            xfail=FSDP2_DOUBLE_DIVIDE_HSDP,
        ),
        case("mixtral", case_id="mixtral-fsdp-tp", fsdp=True, hsdp=True),
        case("mixtral", expert_parallel=True, case_id="mixtral-fsdp-ep", fsdp=True, hsdp=True),
        case(
            "qwen3_moe",
            expert_parallel=True,
            case_id="qwen3_moe-fsdp-ep-from-dp",
            fsdp=True,
            hsdp=True,
            ep_ranks=ExpertRanks.DP,
            xfail=FSDP2_DOUBLE_DIVIDE,
        ),
        case(
            "qwen3_moe",
            expert_parallel=True,
            case_id="qwen3_moe-fsdp-ep-part-of-dp",
            fsdp=True,
            ep_ranks=ExpertRanks.EP_AXIS,
        ),
        case(
            "qwen3_moe",
            expert_parallel=True,
            case_id="qwen3_moe-fsdp-ep-over-dp-tp",
            fsdp=True,
            ep_ranks=ExpertRanks.DP_TP,
            xfail=FSDP2_DOUBLE_DIVIDE,
        ),
    ]
