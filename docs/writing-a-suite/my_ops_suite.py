"""shardcheck suite of my_ops.vocab_parallel_cross_entropy: the worked example of docs/writing-a-suite.md.

shardcheck run --suite-path docs/writing-a-suite/my_ops_suite.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardcheck import BadInput, Case, KnownFailure, Layout, Property, Shard

FAMILY = "my_ops"  # op ids are "my_ops.<name>"; <name> must exist in the module under test
IMPLEMENTATION = "my_ops.py"  # the module under test unless `--impl my_ops=...` names another (relative: to this file)

OP = "my_ops.vocab_parallel_cross_entropy"
LOGITS = Layout(dp=Shard(0), tp=Shard(-1))  # [B, S, V]: the batch over DP, the vocabulary over TP
TOKENS = Layout(dp=Shard(0))  # [B, S]: the batch over DP, the same on every TP rank


# ---- the reference: the definition, on one device, on the full tensors ------------------------------------


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Per-token cross-entropy [B, S] of full logits [B, S, V], computed in promote_types(dtype, float32)."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    loss = F.cross_entropy(x.flatten(0, 1), target.flatten(), ignore_index=ignore_index, reduction="none")
    return loss.view(target.shape)


# ---- inputs -----------------------------------------------------------------------------------------------


def make_inputs(
    gen: torch.Generator,
    b: int,
    s: int,
    v: int,
    scale: float = 3.0,
    masked: float = 0.0,
    ignore_index: int = -100,
    neg_inf: float = 0.0,
) -> dict[str, torch.Tensor]:
    """Full inputs, float64 (the harness casts them to the dtype under test): logits ~ N(0, scale²), a
    fraction `masked` of the targets set to ignore_index, a fraction `neg_inf` of the logits set to -inf
    (vocabulary entries a model masks; never a target's)."""
    logits = torch.randn((b, s, v), generator=gen, dtype=torch.float64) * scale
    target = torch.randint(0, v, (b, s), generator=gen)
    if neg_inf:
        off = (torch.rand((b, s, v), generator=gen) < neg_inf).scatter_(-1, target.unsqueeze(-1), False)
        logits = logits.masked_fill(off, float("-inf"))
    target = target.masked_fill(torch.rand((b, s), generator=gen) < masked, ignore_index)
    return {"logits": logits, "target": target}


# ---- one rank's call, and what else is checked ------------------------------------------------------------


def run(impl, ctx, x):
    """The module under test on this rank's pieces, with the TP group and the case's ignore_index."""
    return impl.vocab_parallel_cross_entropy(
        x["logits"], x["target"], ctx.group("tp"), ignore_index=ctx.params["ignore_index"]
    )


def comm(ctx) -> dict:
    """The collectives one rank may issue. Forward: a MAX and a SUM all-reduce of per-token scalars (n·e and
    2·n·e bytes for n = B_local·S tokens, e bytes per float32 or float64) and an all-gather of the piece sizes
    (8 bytes); backward: none (the softmax is saved). Lower bound: O(n) bytes, never the [B, S, V] logits."""
    b, s = ctx.local_shape("target")
    e = torch.promote_types(ctx.dtype, torch.float32).itemsize
    return {"forward": {"all_reduce@tp": (2, 3 * b * s * e), "all_gather@tp": (1, 8)}, "backward": {}}


def tp_ranks_agree(ctx, full_inputs, local_inputs, outputs) -> list[Property]:
    """The loss is replicated over TP: every TP rank must hold the same bits (ranks that act on a loss they
    disagree about diverge), which the numeric check, within a budget, does not ask."""
    loss = outputs[0].detach().contiguous()
    pieces = [torch.empty_like(loss) for _ in range(ctx.size("tp"))]
    dist.all_gather(pieces, loss, group=ctx.group("tp"))
    differ = [r for r, piece in enumerate(pieces) if not torch.equal(piece, loss)]
    return [
        Property(
            "tp_ranks_agree",
            not differ,
            message=f"TP rank(s) {differ} differ from TP rank {ctx.rank('tp')}" if differ else "",
        )
    ]


# ---- the cases --------------------------------------------------------------------------------------------


def case(
    case_id: str,
    b: int,
    s: int,
    v: int,
    scale: float = 3.0,
    masked: float = 0.0,
    ignore_index: int = -100,
    neg_inf: float = 0.0,
    **extra,
) -> Case:
    """A case of B·S tokens over a vocabulary of V; `extra` goes into the recorded params."""
    return Case(
        op=OP,
        case_id=case_id,
        params=dict(B=b, S=s, V=v, scale=scale, masked=masked, ignore_index=ignore_index, neg_inf=neg_inf, **extra),
        make_inputs=lambda gen: make_inputs(gen, b, s, v, scale, masked, ignore_index, neg_inf),
        reference=lambda x: cross_entropy(x["logits"], x["target"], ignore_index),
        run=run,
        input_layouts={"logits": LOGITS, "target": TOKENS},
        output_layouts=(TOKENS,),
        output_names=("loss",),
        grad_inputs=("logits",),
        comm=comm,
        properties=tp_ranks_agree,
    )


def cases(quick: bool) -> list[Case]:
    out = [
        case("b4s6v37", 4, 6, 37),  # V = 37: TP pieces of 19 + 18 (TP 2), 10 + 10 + 10 + 7 (TP 4)
        case("b4s6v37-masked", 4, 6, 37, masked=0.3),  # ignored targets: loss 0 and no gradient there
        case("b3s5v16-ignore3", 3, 5, 16, masked=0.3, ignore_index=3),  # a real id ignored; B = 3: uneven DP pieces
        case("b4s6v37-scale100", 4, 6, 37, scale=100.0),  # huge logits: only a stable log-sum-exp survives
        case("b4s6v37-neg-inf", 4, 6, 37, neg_inf=0.3),  # -inf logits: masked vocabulary entries
    ]
    if not quick:
        out.append(case("b8s64v1000", 8, 64, 1000))
    return out + bad_input_cases()


def bad_input_cases() -> list[Case]:
    """Input outside the op's contract, for which no answer is right: the op must raise."""

    def short_target(gen):
        x = make_inputs(gen, 2, 4, 11)
        return {"logits": x["logits"], "target": x["target"][:, :3]}

    def ids_beyond_vocab(gen):
        x = make_inputs(gen, 2, 4, 11)
        x["target"][0, 1], x["target"][1, 2] = 11, 40  # V itself, and far beyond
        return x

    common = dict(
        op=OP,
        reference=lambda x: cross_entropy(x["logits"], x["target"]),
        run=run,
        input_layouts={"logits": LOGITS, "target": TOKENS},
        output_layouts=(TOKENS,),
        output_names=("loss",),
        params=dict(B=2, S=4, V=11, ignore_index=-100),
        dtypes=("float64",),
    )
    return [
        Case(
            case_id="bad-target-shape",
            make_inputs=short_target,
            bad_input=BadInput("a target whose shape is not the logits' [B, S]"),
            **common,
        ),
        Case(
            case_id="bad-ids-beyond-vocab",
            make_inputs=ids_beyond_vocab,
            bad_input=BadInput("target ids outside [0, V) other than ignore_index"),
            xfail=KnownFailure(
                "ids >= V are not refused: no rank owns them, and the loss silently becomes "
                "log-sum-exp(logits) with no target term",
                reference="https://example.com/my-team/my-ops/issues/7",
                checks=("property:bad_input",),
            ),
            **common,
        ),
    ]


def bench_cases(quick: bool) -> list[Case]:
    """Realistic sizes for `--bench` (time, peak memory, collectives). params["sweep"] names the parameter the
    report plots time and memory against."""
    return [case(f"bench-s{s}", 1, s, 8192, sweep="S") for s in ((256, 1024) if quick else (512, 1024, 2048, 4096))]
