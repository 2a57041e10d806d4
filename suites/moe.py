"""Suite of the mixture-of-experts family (`shardcheck.distributed_impl.moe`): expert parallelism over `ep` (a part
of dp, harness/core/topology.py), dropless all-to-all dispatch and combine, the load-balancing loss, and a small
decoder whose MLP is the MoE layer, checked module by module (docs/model-cases.md, docs/ops/moe.md).

Op cases (tokens [T, D] split over dp; tp replicates them, so they run at tp 1):
- `moe.route`: each token's top-k weights (softmax, top-k, renormalized), and their gradient.
- `moe.dispatch`: each rank's received rows, placed by the contract's order (local expert, then token) into the
  dense [E, T, D] the reference gives: Layout(dp=Shard(1), ep=Shard(0)), experts over ep, tokens over edp.  A
  permutation: exact in every dtype.
- `moe.combine`: dense expert outputs [E, T, D] (the same layout) back to [T, D] tokens, weighted.
- `moe.aux_loss`: E * sum_e f_e * P_e over the whole batch; each rank's value its summand (Partial over dp).
The model case `moe.parallelize [decoder]` runs one training step of reference/moe.py's MoE decoder at every
(dp, tp) and ep of the world sizes, experts sharded over ep (and their hidden dim over tp).
"""

from __future__ import annotations

import torch

from shardcheck import Case, Layout, ModelCase, Partial, Shard, ours
from shardcheck.reference import moe as ref

FAMILY = "moe"
OP = FAMILY + "."

TOKENS, DIM, EXPERTS, TOP_K = 16, 4, 8, 2
BATCH = Layout(dp=Shard(0))  # [T, ...]: tokens over dp
PER_EXPERT = Layout(dp=Shard(1), ep=Shard(0))  # [E, T, D]: experts over ep, tokens over the rest of dp (edp)
AUX = Layout(dp=Partial())  # each rank's summand of the whole batch's loss
DOC = "docs/ops/moe.md"  # every rule of the family is ours (no seed module)


def router_logits(gen: torch.Generator, tokens: int, experts: int) -> torch.Tensor:
    """[T, E] logits whose top-k stands clear of the rest by ref.MIN_MARGIN or more (no dtype flips a route)."""
    ranks = torch.stack([torch.randperm(experts, generator=gen) for _ in range(tokens)]).to(torch.float64)
    return ranks * 0.8 + 0.2 * torch.rand(tokens, experts, generator=gen, dtype=torch.float64)


def _inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
    logits = router_logits(gen, TOKENS, EXPERTS)
    weights, experts = ref.route(logits, TOP_K)
    return {
        "x": torch.randn(TOKENS, DIM, generator=gen, dtype=torch.float64),
        "y": torch.randn(EXPERTS, TOKENS, DIM, generator=gen, dtype=torch.float64),
        "logits": logits,
        "weights": weights,
        "experts": experts,
    }


def contract_positions(ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """(local expert, token within the edp group's tokens) of each row this rank receives, in the contract's order:
    by local expert, then by token (docs/ops/moe.md#dispatch).  From the full routing, not from the module."""
    experts = ctx.full_inputs["experts"]
    ep, rank = ctx.size("ep"), ctx.rank("ep")
    local = EXPERTS // ep
    chunk = TOKENS // (ctx.size("dp") // ep)
    start = ctx.rank("edp") * chunk
    mine = experts[start : start + chunk]
    rows = [(e, t) for e in range(local) for t in range(chunk) if (mine[t] == rank * local + e).any()]
    if not rows:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    e_idx, t_idx = zip(*rows)
    return torch.tensor(e_idx), torch.tensor(t_idx)


def _dense(rows: torch.Tensor, ctx) -> torch.Tensor:
    """This rank's piece of the dense [E, T, D]: its received rows at their contract positions."""
    e_idx, t_idx = contract_positions(ctx)
    if rows.shape[0] != len(e_idx):
        raise ValueError(f"dispatch gave this rank {rows.shape[0]} rows; its experts are routed {len(e_idx)}")
    shape = (EXPERTS // ctx.size("ep"), TOKENS // (ctx.size("dp") // ctx.size("ep")), rows.shape[-1])
    return rows.new_zeros(shape).index_put((e_idx.to(rows.device), t_idx.to(rows.device)), rows)


def _run_dispatch(impl, ctx, x):
    rows, _ = impl.dispatch(x["x"], x["experts"], EXPERTS, ctx.group("ep"))
    return _dense(rows, ctx)


def _run_combine(impl, ctx, x):
    _, routing = impl.dispatch(x["weights"].new_zeros(x["weights"].shape[0], 1), x["experts"], EXPERTS, ctx.group("ep"))
    e_idx, t_idx = contract_positions(ctx)
    rows = x["y"][e_idx.to(x["y"].device), t_idx.to(x["y"].device)]
    return impl.combine(rows, routing, x["weights"])


def _run_aux(impl, ctx, x):
    _, experts = impl.route(x["logits"], TOP_K)
    return impl.aux_loss(x["logits"], experts, EXPERTS, ctx.group("dp"))


def _op_supports(t) -> bool:
    return TOKENS % t.dp == 0 and EXPERTS % t.ep == 0  # (replicated over tp: every tp rank computes the same)


def op_cases() -> list[Case]:
    common = dict(
        make_inputs=_inputs,
        expert_parallel=True,
        supports=_op_supports,
        case_id=f"t{TOKENS}e{EXPERTS}k{TOP_K}",
        params={"experts": EXPERTS, "top_k": TOP_K},
    )
    return [
        Case(
            op=OP + "route",
            reference=lambda x: ref.route(x["logits"], TOP_K)[0],
            run=lambda impl, ctx, x: impl.route(x["logits"], TOP_K)[0],
            input_layouts={"logits": BATCH},
            output_layouts=(BATCH,),
            grad_inputs=("logits",),
            rule=ours(f"{DOC}#route"),
            **common,
        ),
        Case(
            op=OP + "dispatch",
            reference=lambda x: ref.dispatch(x["x"], x["experts"], EXPERTS),
            run=_run_dispatch,
            input_layouts={"x": BATCH, "experts": BATCH},
            output_layouts=(PER_EXPERT,),
            grad_inputs=("x",),
            rule=ours(f"{DOC}#dispatch"),
            **common,
        ),
        Case(
            op=OP + "combine",
            reference=lambda x: ref.combine(x["y"], x["weights"], x["experts"]),
            run=_run_combine,
            input_layouts={"y": PER_EXPERT, "weights": BATCH, "experts": BATCH},
            output_layouts=(BATCH,),
            grad_inputs=("y", "weights"),
            rule=ours(f"{DOC}#combine"),
            **common,
        ),
        Case(
            op=OP + "aux_loss",
            reference=lambda x: ref.aux_loss(x["logits"], ref.route(x["logits"], TOP_K)[1], EXPERTS),
            run=_run_aux,
            input_layouts={"logits": BATCH},
            output_layouts=(AUX,),
            grad_inputs=("logits",),
            rule=ours(f"{DOC}#aux_loss"),
            **common,
        ),
    ]


# ---- the model case ------------------------------------------------------------------------------------------------

MODEL_BATCH, SEQ = 8, 4
CONFIG = ref.Config()
EXPERT_LAYOUTS = {  # the experts' local pieces (plain tensors): experts over ep, hidden units over tp
    "layer.moe.experts.w1": Layout(ep=Shard(0), tp=Shard(2)),
    "layer.moe.experts.w2": Layout(ep=Shard(0), tp=Shard(1)),
}


def _model_inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {"tokens": torch.randint(0, CONFIG.vocab, (MODEL_BATCH, SEQ), generator=gen)}


def _loss(outputs, inputs, ctx) -> torch.Tensor:
    if ctx is None:
        logits, aux = outputs
        return ref.loss(logits, aux, inputs["tokens"], CONFIG.aux_coef)
    return ctx.impl.loss(outputs, inputs["tokens"], ctx, CONFIG.aux_coef)


def _model_supports(t) -> bool:
    return MODEL_BATCH % t.dp == 0 and CONFIG.experts % t.ep == 0 and CONFIG.hidden % t.tp == 0


def model_case(case_id: str = "decoder") -> ModelCase:
    """The MoE decoder's step, in float64, float32 and bfloat16 at every (dp, ep, tp) of the world sizes
    (docs/performance.md#the-moe-suite: the cost)."""
    return ModelCase(
        op=OP + "parallelize",
        case_id=case_id,
        build=lambda gen: ref.build(CONFIG, gen),
        parallelize=lambda model, ctx: ctx.impl.parallelize(model, ctx),
        make_inputs=_model_inputs,
        loss=_loss,
        input_layouts={"tokens": BATCH},
        param_layouts=dict(EXPERT_LAYOUTS),
        expert_parallel=True,
        supports=_model_supports,
        params={"experts": CONFIG.experts, "top_k": CONFIG.top_k},
    )


def cases(quick: bool = False) -> list:
    return [*op_cases(), model_case()]
