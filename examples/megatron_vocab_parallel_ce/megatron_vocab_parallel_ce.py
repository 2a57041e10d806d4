"""shardcheck suite of Megatron-Core's `tensor_parallel.vocab_parallel_cross_entropy` (the `[megatron]` extra).

    shardcheck run --suite-path examples/megatron_vocab_parallel_ce

What the op takes and computes (megatron/core/tensor_parallel/cross_entropy.py, megatron-core 0.16), the
contract the reference below writes down:
- `vocab_parallel_logits` [*, V/TP]: this rank's contiguous, *equal* piece of the vocabulary (Megatron pads its
  vocabulary to a multiple of TP); Megatron's own order is [S, B, V/TP], any leading shape works;
- `target` [*]: token ids in [0, V), the same on every TP rank; there is no ignore_index: a Megatron job
  multiplies the per-token loss by its loss mask;
- `label_smoothing` α in [0, 1): the target keeps 1 − α and the other V − 1 entries share α,
  loss = (1 − α)·nll + α/(V − 1)·Σ_{v≠target} −log p_v (not torch's α/V spread over all V entries);
- returns the loss [*] of every token, the same on every TP rank, in float32 whatever the logits' dtype
  (bfloat16 logits give a float32 loss; float64 logits are computed in float32 too, which a run reports as a
  `warn`: "float64 computed in float32").

The module under test is `_megatron_ce.py`: Megatron's function, given the case's TP group through
`parallel_state` (Megatron is otherwise never initialised). What a run finds is in the README, section
"Third-party ops (examples/)".
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardcheck import BadInput, Case, KnownFailure, Layout, Property, Shard

FAMILY = "megatron_vocab_parallel_ce"
IMPLEMENTATION = "_megatron_ce.py"

OP = FAMILY + ".vocab_parallel_cross_entropy"
SBV = Layout(dp=Shard(1), tp=Shard(-1))  # [S, B, V] logits: the batch over DP, the vocabulary over TP
SB = Layout(dp=Shard(1))  # [S, B] targets, loss mask, loss: the batch over DP, the same on every TP rank
NV = Layout(dp=Shard(0), tp=Shard(-1))  # [N, V] logits of N = S·B tokens
N = Layout(dp=Shard(0))  # [N] targets, loss

MEGATRON_LS_ISSUE = "https://github.com/NVIDIA/Megatron-LM/issues/737"
MEGATRON_LS_UNDERFLOW = "https://github.com/NVIDIA/Megatron-LM/pull/7466"
MEGATRON_INPLACE = "https://github.com/NVIDIA/Megatron-LM/pull/1594"


def megatron_missing() -> str | None:
    """Why the cases cannot run here, or None."""
    try:
        found = (
            importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
        )
    except (ImportError, ValueError):
        found = False
    return None if found else "megatron-core is not installed (pip install -e .[megatron])"


# ---- the reference: Megatron's contract, on one device, on the full vocabulary -----------------------------------


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token loss [*] of full logits [*, V], in promote_types(dtype, float32); with label smoothing α the
    target keeps 1 − α and the other V − 1 entries share α.  Ids outside [0, V) have no answer (NaN)."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    v = x.shape[-1]
    log_p = x.log_softmax(-1)
    in_range = (target >= 0) & (target < v)
    nll = -log_p.gather(-1, target.long().clamp(0, v - 1).unsqueeze(-1)).squeeze(-1)
    if label_smoothing > 0:
        others = -log_p.sum(-1) - nll  # Σ_{v≠target} −log p_v
        nll = (1 - label_smoothing) * nll + label_smoothing / (v - 1) * others
    return torch.where(in_range, nll, float("nan"))


# ---- the cases ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    s: int = 6
    b: int = 4
    v: int = 64  # 64: equal pieces at TP 1, 2, 4
    flat: bool = False  # [N, V] logits, N = S·B, instead of Megatron's [S, B, V]
    scale: float = 3.0  # logits ~ N(0, scale²)
    label_smoothing: float = 0.0
    neg_inf: float = 0.0  # fraction of the logits set to -inf, targets' included (their loss is +inf)
    masked: float = 0.0  # fraction of the tokens a loss mask zeroes, their target -100 as a tokenizer pads them
    out_of_range: bool = False  # a few targets -100, V and -1 and no loss mask
    target_dtype: torch.dtype = torch.int64

    @property
    def case_id(self) -> str:
        parts = [f"n{self.s * self.b}v{self.v}" if self.flat else f"s{self.s}b{self.b}v{self.v}"]
        if self.scale != 3.0:
            parts.append(f"scale{self.scale:g}")
        if self.label_smoothing:
            parts.append(f"ls{self.label_smoothing:g}")
        if self.neg_inf:
            parts.append("neg-inf")
        if self.masked:
            parts.append("loss-mask")
        if self.out_of_range:
            parts.append("ids-out-of-range")
        if self.target_dtype != torch.int64:
            parts.append(str(self.target_dtype).removeprefix("torch."))
        return "-".join(parts)

    @property
    def params(self) -> dict:
        return {
            "S": self.s,
            "B": self.b,
            "V": self.v,
            "flat": self.flat,
            "scale": self.scale,
            "label_smoothing": self.label_smoothing,
            "neg_inf": self.neg_inf,
            "masked": self.masked,
            "out_of_range": self.out_of_range,
            "target_dtype": str(self.target_dtype).removeprefix("torch."),
        }


def make_inputs(spec: Spec):
    def make(gen: torch.Generator) -> dict[str, torch.Tensor]:
        shape = (spec.s * spec.b,) if spec.flat else (spec.s, spec.b)
        logits = torch.randn((*shape, spec.v), generator=gen, dtype=torch.float64) * spec.scale
        target = torch.randint(0, spec.v, shape, generator=gen)
        if spec.neg_inf:
            logits = logits.masked_fill(torch.rand(logits.shape, generator=gen) < spec.neg_inf, float("-inf"))
        x = {"logits": logits}
        if spec.masked:
            masked = torch.rand(shape, generator=gen) < spec.masked
            target = target.masked_fill(masked, -100)
            x["loss_mask"] = (~masked).double()
        if spec.out_of_range:
            flat = target.view(-1)
            flat[1], flat[5], flat[-2] = -100, spec.v, -1
        x["target"] = target.to(spec.target_dtype)
        return x

    return make


def reference(spec: Spec):
    def ref(x):
        loss = cross_entropy(x["logits"], x["target"], spec.label_smoothing)
        if "loss_mask" in x:  # what a Megatron job does with the per-token loss (the -100s' NaN taken out first)
            loss = torch.where(x["loss_mask"] > 0, loss, 0.0) * x["loss_mask"]
        return loss

    return ref


def run(spec: Spec):
    def call(impl, ctx, x):
        loss = impl.vocab_parallel_cross_entropy(
            vocab_parallel_logits=x["logits"],
            target=x["target"],
            label_smoothing=spec.label_smoothing,
            tp_group=ctx.group("tp"),
        )
        return loss * x["loss_mask"] if "loss_mask" in x else loss

    return call


def comm(ctx) -> dict:
    """Forward: three all-reduces over TP of per-token float32 scalars (the row max, the target's logit, Σ exp):
    3 calls, 3·n·4 bytes for n tokens on this rank; backward: none (the softmax is saved).  Lower bound: O(n)
    bytes, never the [*, V] logits (two calls would do: the target's logit and Σ exp could share one)."""
    n = math.prod(ctx.local_shape("target"))
    return {"forward": {"all_reduce@tp": (3, 3 * n * 4)}, "backward": {}}


def tp_ranks_agree(ctx, full, local, outs) -> list[Property]:
    """The loss is replicated over TP: every TP rank must hold the same bits (a numeric check within a budget
    does not ask that; ranks that disagree about their loss diverge)."""
    loss = outs[0].detach().contiguous()
    pieces = [torch.empty_like(loss) for _ in range(ctx.size("tp"))]
    dist.all_gather(pieces, loss, group=ctx.group("tp"))
    differ = [r for r, p in enumerate(pieces) if not torch.equal(p.nan_to_num(), loss.nan_to_num())]
    worst = max(((p - loss).abs().nan_to_num().max().item() for p in pieces), default=0.0)
    return [
        Property(
            "tp_ranks_agree",
            not differ,
            value=worst,
            message=f"TP rank(s) {differ} hold another loss than TP rank {ctx.rank('tp')} "
            f"(max |difference| {worst:.3g})"
            if differ
            else "",
        )
    ]


def logits_unchanged(layout: Layout):
    """The caller's logits after the call and its backward are what it passed (a loss that overwrites them
    silently corrupts whatever else reads them: a z-loss, logging, a second loss on the same logits); with
    tp_ranks_agree, as a case has one properties function."""

    def check(ctx, full, local, outs) -> list[Property]:
        props = tp_ranks_agree(ctx, full, local, outs)
        passed = layout.local(full["logits"], ctx.mesh, full).to(local["logits"].device)
        now = local["logits"].detach()
        if torch.equal(now.nan_to_num(), passed.nan_to_num()):
            return props + [Property("logits_unchanged", True)]
        grad = local["logits"].grad
        holds = " (they now hold the logits' gradient)" if grad is not None and torch.equal(now, grad) else ""
        worst = (now.double() - passed.double()).abs().nan_to_num(posinf=math.inf).max().item()
        return props + [
            Property(
                "logits_unchanged",
                False,
                value=worst,
                message=f"the caller's {str(now.dtype).removeprefix('torch.')} logits were "
                f"overwritten in place{holds}: max |change| {worst:.3g}",
            )
        ]

    return check


def case(
    spec: Spec,
    *,
    name: str = "",
    properties=tp_ranks_agree,
    xfail: KnownFailure | None = None,
    bad_input: BadInput | None = None,
    dtypes: tuple[str, ...] = ("float64", "float32", "bfloat16"),
) -> Case:
    tokens = N if spec.flat else SB
    layouts = {"logits": NV if spec.flat else SBV, "target": tokens, "loss_mask": tokens}
    raising = bad_input is not None and bad_input.interpretation is None  # no answer to compare: no comm either
    return Case(
        op=OP,
        case_id=name or spec.case_id,
        params=spec.params,
        make_inputs=make_inputs(spec),
        reference=reference(spec),
        run=run(spec),
        input_layouts=layouts,
        output_layouts=(tokens,),
        output_names=("loss",),
        grad_inputs=("logits",),
        comm=None if raising else comm,
        properties=None if raising else properties,
        supports=lambda t, n=spec.b * (spec.s if spec.flat else 1): n % t.dp == 0,
        xfail=xfail,
        bad_input=bad_input,
        dtypes=dtypes,
        skip_reason=megatron_missing(),
    )


# Label smoothing at ordinary logits runs in float64 and float32: Megatron computes in float32 whatever the input, so
# bfloat16 logits only round the input, and on this small vocabulary the piece-local smoothing error at TP > 1 is
# within bfloat16's budget (the harness would file it as bfloat16 math, not as this defect).
SMOOTHING_DTYPES = ("float64", "float32")
SMOOTHING_TP = KnownFailure(
    "label smoothing at TP > 1: each rank smooths over its own vocabulary piece (`vocab_size` is the piece's size, "
    "`log_probs.mean(dim=-1)` the piece's mean, never all-reduced), so the TP ranks return different losses and "
    "every rank's gradient is off",
    reference=MEGATRON_LS_ISSUE,
    checks=("forward", "grad:*", "property:tp_ranks_agree"),
    when=lambda t, dtype: t.tp > 1,
)


def cases(quick: bool) -> list[Case]:
    out = [
        case(Spec()),  # Megatron's [S, B, V/TP]
        case(Spec(flat=True, v=40)),  # [N, V/TP]: any leading shape; V = 40: pieces of 20 and 10
        case(Spec(scale=100.0)),  # huge logits: only a max-shifted log-sum-exp survives
        case(Spec(neg_inf=0.3)),  # -inf logits, a few at the target: +inf loss there, a finite gradient
        case(Spec(masked=0.3)),  # Megatron's masking: loss · loss_mask, targets -100 under the mask
        case(Spec(label_smoothing=0.1), xfail=SMOOTHING_TP, dtypes=SMOOTHING_DTYPES),
        case(
            Spec(label_smoothing=0.1, scale=100.0),
            xfail=KnownFailure(
                "label smoothing with huge logits: the smoothing term takes log(softmax) after the softmax underflowed "
                "to 0 (logit gaps beyond ~104 in float32), so the loss is +inf where it is finite, at every TP; "
                "at TP > 1 the piece-local smoothing of issue 737 comes on top (gradients off)",
                reference=MEGATRON_LS_UNDERFLOW,
                checks=("forward", "grad:*"),
            ),
        ),
        # the caller's logits after the call and its backward
        case(
            Spec(),
            name="caller-logits",
            properties=logits_unchanged(SBV),
            xfail=KnownFailure(
                "float32 logits are overwritten in place: `.float()` of a float32 tensor is the tensor itself, and the "
                "forward's `-=`, `exp(out=)` and `div_` turn the caller's logits into the softmax, the backward's "
                "in-place update into the gradient (float64 and bfloat16 inputs are copied by `.float()`)",
                reference=MEGATRON_INPLACE,
                checks=("property:logits_unchanged",),
                when=lambda t, dtype: dtype == "float32",
            ),
        ),
    ]
    if not quick:
        out += [
            case(Spec(label_smoothing=0.6), xfail=SMOOTHING_TP, dtypes=SMOOTHING_DTYPES),
            case(Spec(target_dtype=torch.int32)),  # int32 token ids
        ]
    return out + bad_input_cases()


def bad_input_cases() -> list[Case]:
    return [
        case(
            Spec(out_of_range=True),
            dtypes=("float64",),
            bad_input=BadInput(
                "target ids outside [0, V) (-100, V, -1) without a loss mask: the op has no ignore_index"
            ),
            xfail=KnownFailure(
                "ids outside [0, V) are not refused: no rank owns them, so each such token silently gets the loss "
                "log Σ exp(logits − max) (the target's logit taken as 0 after the max shift) and the softmax as its "
                "gradient",
                checks=("property:bad_input",),
                reference="megatron/core/tensor_parallel/cross_entropy.py, calculate_predicted_logits: "
                "`target_mask` zeroes the predicted logit of any id outside this rank's piece, no check",
            ),
        ),
        case(
            Spec(v=37),
            name="s6b4v37-uneven-vocab",
            bad_input=BadInput(
                "a vocabulary TP does not divide (unequal pieces: 19 + 18 at TP 2, 10 + 10 + 10 + 7 at TP 4)",
                interpretation="the cross-entropy over the whole vocabulary, as for equal pieces",
            ),
            xfail=KnownFailure(
                "unequal vocabulary pieces give wrong losses and gradients without a word: each rank takes its piece "
                "to start at rank·V_local (VocabUtility.vocab_range_from_per_partition_vocab_size), so from TP rank 1 "
                "on the pieces overlap or leave ids unowned",
                checks=("forward", "grad:*"),
                when=lambda t, dtype: t.tp > 1,
                reference="megatron/core/tensor_parallel/utils.py, vocab_range_from_per_partition_vocab_size: "
                "start = rank · per_partition_vocab_size; Megatron pads its own vocabulary to a "
                "multiple of TP, and the op does not check",
            ),
        ),
        case(
            Spec(label_smoothing=-0.1),
            dtypes=("float64",),
            bad_input=BadInput("label_smoothing < 0 (the docstring's range is [0, 1))"),
            xfail=KnownFailure(
                "a negative label_smoothing is silently ignored: the op computes the unsmoothed loss",
                checks=("property:bad_input",),
                reference="megatron/core/tensor_parallel/cross_entropy.py, _VocabParallelCrossEntropy.forward: "
                "`if label_smoothing > 0:` skips smoothing, and `assert 1.0 > label_smoothing > 0.0` is "
                "reached only inside it",
            ),
        ),
        case(
            Spec(label_smoothing=1.0),
            dtypes=("float64",),
            bad_input=BadInput("label_smoothing = 1 (the docstring's range is [0, 1))"),
        ),  # Megatron asserts: loud
    ]


def bench_cases(quick: bool) -> list[Case]:
    """`shardcheck run --bench`: the loss of S tokens over a vocabulary of 8,192, forward and backward, float32
    logits (the CLI's dtype).  Sweep "S" at one rank; sweep "tp": one case at TP 1, 2 and 4 (dp = cp = 1)."""

    def bench(sweep: str, s: int, supports) -> Case:
        spec = Spec(s=s, b=1, v=8192)
        return dataclasses.replace(
            case(spec),
            case_id=f"bench-{sweep}-s{s}v{spec.v}",
            properties=None,
            params={**spec.params, "sweep": sweep},
            supports=supports,
        )

    lengths = (256, 1024) if quick else (512, 1024, 2048, 4096)
    return [bench("S", s, lambda t: t.size == 1) for s in lengths] + [bench("tp", 2048, lambda t: t.dp == t.cp == 1)]
