"""titan suite: torchtitan's Llama 3 and Qwen3-MoE under torchtitan's own `model.parallelize(parallel_dims)`.

One training step of each model (tiny random config: 2 layers, dim 16, 4 heads, vocab 32, batch 4, sequence 8; MoE 4
experts, top 2; suites/_titan_models.py) under torchtitan's plan, against the same model on one device, module by
module (docs/model-cases.md), at world sizes 1, 2, 4:

- `llama3-tp` / `llama3-tp-sp`: tensor parallel without / with sequence parallelism (torchtitan's default);
- `qwen3_moe-tp-sp`: Qwen3-MoE, experts tensor-parallel (ep 1);
- `qwen3_moe-ep-sp`: Qwen3-MoE, experts expert-parallel on the TP ranks (ep == tp);
- `llama3-fsdp-tp-sp`, `qwen3_moe-fsdp-ep-sp`: the same under torchtitan's whole parallelize function, FSDP2 over
  dp 2 or 4 (HSDP at `--topology dp=4,dp_replicate=2`), alone and with TP; the MoE model's EP over the FSDP and TP
  ranks (ep = dp_shard x tp: EP borrowed from FSDP).  torchtitan's trainer's convention: FSDP's gradient division
  off, each rank's loss its token sum over the global token count (`loss_layout=Layout(dp=Partial(), cp=Partial())`);
- `llama3-cp-tp-sp`, `qwen3_moe-cp-ep-sp`: the same functions with context parallelism over cp 2 or 4 (torchtitan's
  SDPA CP path: q/k/v as cp-sharded DTensors under torch's ring attention, on CPU through shardcheck's shim), alone,
  with TP or with FSDP; FSDP over dp x cp reduces the gradients over cp too.  The batch and its positions are
  head-tail over cp as torchtitan's `prepare_context_parallel_input` shards them (`HeadTail(1)`);
- `llama3-tp-spmd_types`: `llama3-tp` under torchtitan's default backend, spmd_types (the gradient at the final
  norm's output unchecked: each rank's summand over TP there).

Dtypes: float64, float32 and bfloat16.  torchtitan's RoPE computes in float32 whatever the model's dtype
(`query.float()`, torchtitan/models/common/rope.py), so a float64 step is float32-accurate from the first attention
on, and the sharded and single-device steps differ there by a float32 ulp: float64 items are judged with float32's
budgets (`ModelCase(compute_dtype=torch.float32)`, docs/third-party-models.md).  The FSDP and CP cases run in float32
and bfloat16 only: torchtitan names FSDP's parameter dtype from a map without float64.  The MoE
model's routers route every token of the case's inputs with a margin (suites/_routing.py), so no top-k flips between
two correct bfloat16 runs that round differently.

Needs the optional extra `pip install -e .[titan]`; without it every case is recorded `skip` with the reason.
Third-party models: docs/third-party-models.md.
"""

from __future__ import annotations

from shardcheck import HeadTail, Layout, ModelCase, Partial, Shard
from shardcheck.suites import _titan_models as titan

FAMILY = "titan"
IMPLEMENTATION = __file__
# Minutes of a run on CPU ranks, and an optional extra: run when named (--suite, --op), not by a plain `shardcheck run`.
RUN_BY_DEFAULT = False
# DTensor parameters and activations.  spmd_types (torchtitan's default, plain local tensors) only in
# `llama3-tp-spmd_types`: under it the sequence-parallel norms' weight gradients are left to FSDP to all-reduce over
# TP ("pending BWD AR handled by FSDP", torchtitan/models/common/decoder_sharding.py), and torch 2.13's FSDP2 refuses
# its plain parameters (tests/fixtures/upstream/titan_spmd_types_fsdp.py, docs/third-party-models.md).
BACKEND = "partial_dtensor"


def parallelize(model, ctx):
    """torchtitan's own plan (the op every case names; each case's plan is a _titan_models.Plan)."""
    return titan.Plan("llama3", False, True, BACKEND)(model, ctx)


EXPERTS = "*.routed_experts.inner_experts"
SPMD_NORM = "norm"  # the final norm: under spmd_types the gradient at its output is a summand over TP


def _no_dp(t) -> bool:
    return t.dp == 1 and t.cp == 1 and titan.HEADS % t.tp == 0


def _with_dp(t) -> bool:
    """FSDP (or HSDP, dp_replicate > 1) over dp 2 or 4, with or without TP; no CP."""
    return t.dp > 1 and t.cp == 1 and titan.HEADS % t.tp == 0 and titan.BATCH % t.dp == 0


def _with_cp(t) -> bool:
    """CP over cp 2 or 4 (two head-tail chunks per rank: SEQ % 2cp), with or without TP (sequence-parallel: each rank's
    SEQ / cp tokens split over tp) and FSDP (or HSDP) over dp."""
    heads_and_batch = titan.HEADS % t.tp == 0 and titan.BATCH % t.dp == 0
    return t.cp > 1 and titan.SEQ % (2 * t.cp) == 0 and (titan.SEQ // t.cp) % t.tp == 0 and heads_and_batch


def case(
    model: str,
    expert_parallel: bool,
    sequence_parallel: bool,
    case_id: str | None = None,
    edit=None,
    backend: str = BACKEND,
    fsdp: bool = False,
    arch: titan.Arch = titan.ARCH,
    supports=None,
    params: dict | None = None,
    context_parallel: bool = False,
    unchecked: tuple[str, ...] = (),
):
    """`fsdp`: torchtitan's whole parallelize function, FSDP2 (HSDP at dp_replicate > 1) over the batch split on dp,
    each rank's loss its summand of the global mean (torchtitan's trainer: gradient division off).
    `context_parallel`: the same function with CP over cp (torchtitan's SDPA under torch's ring attention, FSDP over
    dp x cp), the batch and its positions head-tail over cp.  `arch`, `supports` and `params`: a user's job config's
    architecture, topology and what the case records of it (_titan_config.py).  `unchecked`: more modules whose output
    (and the gradient at it) no layout maps."""
    fsdp = fsdp or context_parallel  # torchtitan's CP gradients are reduced over cp by FSDP (its mesh: dp_shard x cp)
    plan = titan.Plan(model, expert_parallel, sequence_parallel, backend, edit, data_parallel=fsdp, arch=arch)
    kind = "cp-" if context_parallel else "fsdp-" if fsdp else ""
    name = f"{model}-{kind}{'ep' if expert_parallel else 'tp'}{'-sp' if sequence_parallel else ''}"
    name += "" if backend == BACKEND else f"-{backend}"
    # torchtitan's prepare_context_parallel_input: tokens, labels and positions head-tail over cp (its default
    # "headtail" load balancer, torch's _HeadTailLoadBalancer: HeadTail's chunks)
    rows = Layout(dp=Shard(0), cp=HeadTail(1)) if context_parallel else Layout(dp=Shard(0))
    batch = {"tokens": rows, "labels": rows} | ({"positions": rows} if context_parallel else {})
    # the experts' rows under FSDP (EP or not) are this rank's batch's tokens sorted by expert: no layout maps them
    whole_rows = not (expert_parallel or fsdp)
    return ModelCase(
        op=f"{FAMILY}.parallelize",
        case_id=case_id or name,
        dtypes=titan.FSDP_DTYPES if fsdp else titan.DTYPES,  # (every MoE router routes with a margin: _routing.py)
        compute_dtype=titan.COMPUTE_DTYPE,
        # the experts' rows: under TP each rank's summand (the hidden dim split), under EP or FSDP the tokens routed to
        # this rank's experts (no layout maps them; the routed experts' output is compared)
        param_layouts=plan.layouts,
        activation_layouts={EXPERTS: Layout(tp=Partial())} if whole_rows else {},
        unchecked_modules=unchecked + (() if whole_rows else (EXPERTS,)),
        build=titan.build(model, arch),
        parallelize=plan,
        make_inputs=titan.make_inputs_with_positions if context_parallel else titan.make_inputs,
        model_inputs=("tokens", "positions") if context_parallel else ("tokens",),
        loss=titan.loss,
        step_context=plan.step_context,
        world_group=True,
        supports=supports or (_with_cp if context_parallel else _with_dp if fsdp else _no_dp),
        hsdp=fsdp,
        input_layouts=batch if fsdp else {},
        loss_layout=Layout(dp=Partial(), cp=Partial()),
        skip_reason=titan.titan_missing(),
        params={
            "model": model,
            "expert_parallel": expert_parallel,
            "sequence_parallel": sequence_parallel,
            "backend": backend,
            "fsdp": fsdp,
            "context_parallel": context_parallel,
            **(params or {}),
        },
    )


def cases(quick: bool = False) -> list[ModelCase]:
    if quick:  # one model under one plan (the default run's --quick, the bench runs of every suite)
        return [case("llama3", False, True)]
    return [
        case("llama3", False, False),
        case("llama3", False, True),
        case("qwen3_moe", False, True),
        case("qwen3_moe", True, True),
        case("llama3", False, True, fsdp=True),
        case("qwen3_moe", True, True, fsdp=True),
        case("llama3", False, True, context_parallel=True),
        case("qwen3_moe", True, True, context_parallel=True),
        # torchtitan's default backend, where it runs whole on torch 2.13: TP without SP (under SP the norms' weight
        # gradients wait for FSDP's all-reduce, and torch 2.13's FSDP2 refuses its plain parameters).  The gradient
        # at the final norm's output is each rank's summand over TP there (the norm's own output redistribution
        # all-reduces it): unchecked; norm.weight's gradient and every gradient below it are judged
        # (docs/third-party-models.md)
        case("llama3", False, False, backend="spmd_types", unchecked=(SPMD_NORM,)),
    ]
