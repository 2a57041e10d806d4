"""shardcheck suite of PyTorch's loss parallelism: `F.cross_entropy`, `F.nll_loss` and `F.log_softmax` on
vocab-sharded DTensor logits inside `torch.distributed.tensor.parallel.loss_parallel()`.

    shardcheck run --suite-path examples/torch_loss_parallel

What `loss_parallel` documents (torch 2.13, torch/distributed/tensor/parallel/loss.py), the contract here:
- the input is a DTensor sharded on the class dim (dim 1, dim 0 for one sample) over exactly one mesh dim; other
  mesh dims Shard (the batch) or Replicate;
- the target holds class indices: a plain tensor where its derived placements are all Replicate (a 1-D mesh),
  else a DTensor; class probabilities are "currently not supported";
- `weight` is replicated; `label_smoothing` is "currently not supported"; `reduction="mean"` only on a 1-D mesh;
- the backward must run inside the context (`ctx.keep_open` keeps it open through the harness's backward, as
  a training step does);
- everything else is F.cross_entropy's own contract, which the reference below writes out.

The module under test is `_torch_loss_parallel_ops.py` (torch's own functions under the names called here).
What a run finds is in the README, section "Third-party ops (examples/)".
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from shardcheck import REPLICATED, BadInput, Case, KnownFailure, Layout, Partial, Replicate, Shard

FAMILY = "torch_loss_parallel"
IMPLEMENTATION = "_torch_loss_parallel_ops.py"

IDENTITY_BACKWARD = "https://github.com/pytorch/pytorch/issues/190746"
LOSS_PY = "torch/distributed/tensor/parallel/loss.py"


# ---- the reference: F.cross_entropy's definition on one device, written out --------------------------------------


def log_softmax(logits: torch.Tensor, dim: int) -> torch.Tensor:
    return logits - logits.logsumexp(dim, keepdim=True)


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Cross-entropy of logits [N, C, ...] (or one sample [C]) and class indices [N, ...] or class probabilities
    [N, C, ...]: per position −Σ_c q_c·w_c·log p_c with q the target (one-hot, or the probabilities), smoothed as
    (1 − α)·q + α/C; positions whose index is ignore_index count for nothing; "mean" divides by the summed weight
    of the counted positions (their number without weight; the number of positions for probabilities)."""
    dim = 1 if logits.ndim > 1 else 0
    classes = logits.shape[dim]
    log_p = log_softmax(logits, dim)
    w_shape = [1] * logits.ndim
    w_shape[dim] = classes
    w = weight.view(w_shape) if weight is not None else torch.ones(w_shape, dtype=logits.dtype, device=logits.device)
    if target.is_floating_point():
        q = target * (1 - label_smoothing) + label_smoothing / classes
        loss = -(log_p * q * w).sum(dim)
        return {"none": loss, "sum": loss.sum(), "mean": loss.sum() / (logits.numel() / classes)}[reduction]
    counted = target != ignore_index
    index = torch.where(counted, target, 0).unsqueeze(dim)
    w_target = torch.where(counted, w.expand_as(log_p).gather(dim, index).squeeze(dim), 0)
    loss = torch.where(counted, -log_p.gather(dim, index).squeeze(dim) * w_target, 0)
    if label_smoothing:
        smooth = torch.where(counted, -(log_p * w).sum(dim), 0)
        loss = (1 - label_smoothing) * loss + label_smoothing / classes * smooth
    return {"none": loss, "sum": loss.sum(), "mean": loss.sum() / w_target.sum()}[reduction]


# ---- the cases ----------------------------------------------------------------------------------------------------

SHAPES = {  # logits shape, its class dim, the target's shape; n rows (the batch), s positions, v classes
    "nv": (lambda n, s, v: (n, v), 1, lambda n, s: (n,)),
    "bvs": (lambda n, s, v: (n, v, s), 1, lambda n, s: (n, s)),  # [B, V, S]: the class dim where F wants it
    "bsv-transpose": (lambda n, s, v: (n, s, v), 2, lambda n, s: (n, s)),  # a model's [B, S, V], .transpose(1, 2)
    "bsv-flatten": (lambda n, s, v: (n, s, v), 2, lambda n, s: (n, s)),  # a model's [B, S, V], .flatten(0, 1)
    "bvhw": (lambda n, s, v: (n, v, s, 2), 1, lambda n, s: (n, s, 2)),  # [B, V, H, W]: the K-dimensional loss
    "bvh1": (lambda n, s, v: (n, v, s, 1), 1, lambda n, s: (n, s, 1)),  # [B, V, H, 1]
    "v": (lambda n, s, v: (v,), 0, lambda n, s: ()),  # one sample
}


@dataclass(frozen=True)
class Spec:
    op: str = "cross_entropy"  # "cross_entropy", "nll_loss" (of log_softmax), "log_softmax"
    shape: str = "nv"
    n: int = 8
    s: int = 3
    v: int = 37  # pieces of 19 + 18 at TP 2, 10 + 10 + 10 + 7 at TP 4
    reduction: str = "mean"
    mesh_2d: bool = False  # the logits a DTensor on the (dp, tp) mesh, batch over dp; else on the tp mesh
    masked: float = 0.0  # fraction of the targets set to ignore_index
    ignore_index: int = -100
    weight: bool = False
    label_smoothing: float = 0.0
    probs: bool = False  # class-probability targets, sharded like the logits
    out_of_range: bool = False  # a few targets V and -1 (not ignore_index)
    scale: float = 3.0
    neg_inf: float = 0.0  # fraction of the logits set to -inf, targets' included (their loss is +inf)
    backward_outside: bool = False  # the context closed before the backward

    @property
    def class_dim(self) -> int:
        return SHAPES[self.shape][1]

    @property
    def case_id(self) -> str:
        dims = {"nv": f"n{self.n}v{self.v}", "v": f"v{self.v}"}.get(
            self.shape, f"{self.shape}-n{self.n}s{self.s}v{self.v}"
        )
        parts = [dims, self.reduction] if self.op != "log_softmax" else [dims]
        parts += [
            tag
            for tag, on in (
                ("mesh-dp-tp", self.mesh_2d),
                (f"masked{self.masked:g}", self.masked),
                (f"ignore{self.ignore_index}", self.ignore_index != -100),
                ("weight", self.weight),
                (f"ls{self.label_smoothing:g}", self.label_smoothing),
                ("probs", self.probs),
                ("ids-out-of-range", self.out_of_range),
                (f"scale{self.scale:g}", self.scale != 3.0),
                ("neg-inf", self.neg_inf),
                ("backward-outside", self.backward_outside),
            )
            if on
        ]
        return "-".join(parts)

    @property
    def params(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def make_inputs(spec: Spec):
    logits_shape, dim, target_shape = SHAPES[spec.shape]

    def make(gen: torch.Generator) -> dict[str, torch.Tensor]:
        logits = torch.randn(logits_shape(spec.n, spec.s, spec.v), generator=gen, dtype=torch.float64) * spec.scale
        if spec.neg_inf:
            logits = logits.masked_fill(torch.rand(logits.shape, generator=gen) < spec.neg_inf, float("-inf"))
        x = {"logits": logits}
        if spec.probs:
            x["target"] = torch.randn(logits.shape, generator=gen, dtype=torch.float64).softmax(dim)
        else:
            target = torch.randint(0, spec.v, target_shape(spec.n, spec.s), generator=gen)
            if spec.masked:
                ignored = torch.rand(target.shape, generator=gen) < spec.masked
                ignored.view(spec.n, -1)[::2, 0] = True  # every DP piece (2 rows or more) holds one: ranks alike
                target = target.masked_fill(ignored, spec.ignore_index)
            if spec.out_of_range:
                target.view(-1)[1], target.view(-1)[-2] = spec.v, -1
            x["target"] = target
        if spec.weight:
            x["weight"] = torch.rand(spec.v, generator=gen, dtype=torch.float64) + 0.5
        return x

    return make


def reference(spec: Spec):
    def ref(x):
        logits = x["logits"]
        if spec.shape == "bsv-transpose":
            logits = logits.transpose(1, 2)
        if spec.shape == "bsv-flatten":
            logits = logits.flatten(0, 1)
        if spec.op == "log_softmax":
            return log_softmax(logits, spec.class_dim)
        target = x["target"].flatten() if spec.shape == "bsv-flatten" else x["target"]
        loss = cross_entropy(logits, target, x.get("weight"), spec.ignore_index, spec.reduction, spec.label_smoothing)
        return loss.view(x["target"].shape) if spec.reduction == "none" else loss

    return ref


def vocab_sharded(ctx, spec: Spec, name: str, local: torch.Tensor) -> DTensor:
    """This rank's piece as the DTensor a vocab-parallel output layer returns: the class dim over the tp mesh dim
    (and the batch over dp on the 2-D mesh), with the global shape given (pieces may be unequal)."""
    dim = spec.class_dim
    if spec.mesh_2d:
        mesh, placements, shape = ctx.mesh["dp", "tp"], [Shard(0), Shard(dim)], list(ctx.full_shapes[name])
    else:
        mesh, placements, shape = ctx.mesh["tp"], [Shard(dim)], list(local.shape)
        shape[dim] = ctx.full_shapes[name][dim]
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape), stride=stride)


def run(spec: Spec):
    def call(impl, ctx, x):
        logits = vocab_sharded(ctx, spec, "logits", x["logits"])
        target = x["target"]
        if spec.probs:
            target = vocab_sharded(ctx, spec, "target", target)
        elif spec.mesh_2d:  # the documented rule: a batch-sharded target is a DTensor on the same mesh
            target = DTensor.from_local(target, ctx.mesh["dp", "tp"], [Shard(0), Replicate()], run_check=False)
        if spec.backward_outside:
            with impl.loss_parallel():
                out = compute(impl, spec, logits, target, x.get("weight"))
        else:  # a training step: forward and backward inside the context
            ctx.keep_open(impl.loss_parallel())
            out = compute(impl, spec, logits, target, x.get("weight"))
        local = value_on_this_rank(out)
        return local.view(x["target"].shape) if spec.shape == "bsv-flatten" and spec.reduction == "none" else local

    return call


def value_on_this_rank(out: DTensor) -> torch.Tensor:
    """What this rank holds of the result, as the caller reads it: a Partial sum over tp (the class-probability loss
    sums its classes' pieces) is summed first; the batch stays sharded, the log-probabilities vocab-sharded."""
    if out.placements[-1].is_partial():  # tp is the mesh's last dim
        out = out.redistribute(out.device_mesh, [*out.placements[:-1], Replicate()])
    return out.to_local()


def compute(impl, spec: Spec, logits: DTensor, target, weight) -> DTensor:
    if spec.shape == "bsv-transpose":
        logits = logits.transpose(1, 2)
    if spec.shape == "bsv-flatten":
        logits, target = logits.flatten(0, 1), target.flatten()
    dim = 1 if logits.ndim > 1 else 0
    if spec.op == "log_softmax":
        return impl.log_softmax(input=logits, dim=dim)
    kwargs = dict(weight=weight, ignore_index=spec.ignore_index, reduction=spec.reduction)
    if spec.op == "nll_loss":
        return impl.nll_loss(input=impl.log_softmax(input=logits, dim=dim), target=target, **kwargs)
    if spec.label_smoothing:
        kwargs["label_smoothing"] = spec.label_smoothing
    return impl.cross_entropy(input=logits, target=target, **kwargs)


def comm(spec: Spec):
    """Forward, per rank: log_softmax all-reduces the row max and Σ exp over tp (2 calls of n values each, n the
    positions on this rank, in the computation dtype: float32 for bfloat16); the loss one more, the target's
    log-probability (n values in the logits' dtype).  Backward: none (the gradient softmax − one-hot is local).
    Lower bound: O(n) bytes, never the [n, V] logits."""

    def contract(ctx) -> dict:
        n = math.prod(ctx.local_shape("logits")) // ctx.local_shape("logits")[spec.class_dim]
        compute_bytes = torch.promote_types(ctx.dtype, torch.float32).itemsize
        calls, nbytes = 2, 2 * n * compute_bytes
        if spec.op != "log_softmax":
            calls, nbytes = calls + 1, nbytes + n * ctx.dtype.itemsize
        return {"forward": {"all_reduce@tp": (calls, nbytes)}, "backward": {}}

    return contract


def case(
    spec: Spec,
    *,
    xfail: KnownFailure | None = None,
    bad_input: BadInput | None = None,
    dtypes: tuple[str, ...] = ("float64", "float32", "bfloat16"),
) -> Case:
    dim = spec.class_dim
    logits_layout = Layout(dp=Shard(0), tp=Shard(dim)) if spec.shape != "v" else Layout(tp=Shard(0))
    target_layout = logits_layout if spec.probs else Layout(dp=Shard(0)) if spec.shape != "v" else REPLICATED
    if spec.op == "log_softmax":
        output = logits_layout
    else:
        output = {"none": target_layout, "sum": Layout(dp=Partial()), "mean": REPLICATED}[spec.reduction]
    # a mean over this rank's rows (on the tp mesh), or one sample: the reference's full batch only at dp = 1
    per_rank = spec.op != "log_softmax" and spec.reduction == "mean" and not spec.mesh_2d or spec.shape == "v"
    plain = bad_input is None or not (spec.probs or spec.backward_outside or spec.label_smoothing)
    return Case(
        op=f"{FAMILY}.{spec.op}",
        case_id=spec.case_id,
        params=spec.params,
        make_inputs=make_inputs(spec),
        reference=reference(spec),
        run=run(spec),
        input_layouts={"logits": logits_layout, "target": target_layout},
        output_layouts=(output,),
        output_names=("log_probs" if spec.op == "log_softmax" else "loss",),
        grad_inputs=("logits",),
        comm=comm(spec) if plain else None,
        supports=lambda t: t.dp == 1 if per_rank else spec.n % t.dp == 0,
        xfail=xfail,
        bad_input=bad_input,
        dtypes=dtypes,
    )


def cases(quick: bool) -> list[Case]:
    ce = [
        case(Spec()),
        case(Spec(reduction="sum")),
        case(Spec(reduction="none", masked=0.3)),  # ignored targets: loss 0, no gradient
        case(Spec(masked=0.3, ignore_index=3)),  # a real class id ignored
        case(Spec(weight=True)),
        case(Spec(shape="bvs", reduction="none", masked=0.3)),  # [B, V, S]
        case(Spec(shape="bsv-transpose", reduction="none")),  # a model's [B, S, V] output, class dim moved to 1
        case(Spec(shape="bsv-flatten")),  # a model's [B, S, V] output, flattened to [B·S, V]
        case(Spec(scale=100.0)),  # huge logits: only a max-shifted log-sum-exp survives
        case(Spec(reduction="none", neg_inf=0.3)),  # -inf logits, a few at the target: +inf loss there
        case(Spec(mesh_2d=True, reduction="sum")),  # (dp, tp) mesh: a Partial sum over dp
        case(Spec(mesh_2d=True, reduction="none", masked=0.3)),
        case(
            Spec(weight=True, masked=0.3, reduction="none"),
            xfail=KnownFailure(
                "weight with ignored targets: the backward raises `RuntimeError: index -100 is out of bounds`: "
                "it gathers the weight at the raw target, ignore_index included, where the forward uses the masked one",
                checks=("grad:*",),
                reference=f"{LOSS_PY}, _nll_loss_and_log_softmax_backward: "
                "`w_target = torch.gather(w, channel_dim, target)` (the forward gathers at "
                "`safe_target_`); single-device F.cross_entropy accepts the same input",
            ),
        ),
        case(
            Spec(shape="bvhw", reduction="none"),
            xfail=KnownFailure(
                "4-D input [B, V, H, W] with H, W > 1: wrong gradient (the forward is right): the backward's one-hot "
                "lands at the position with H and W swapped",
                checks=("grad:*",),
                reference=f"{LOSS_PY}, _nll_loss_and_log_softmax_backward, the x.dim() > 2 branch: "
                "`grad_input.transpose(channel_dim, -1)` turns [B, V, H, W] into [B, W, H, V], "
                "whose rows are in (b, w, h) order, while the flattened target is in "
                "(b, h, w) order; 3-D and 5-D inputs (torch views those as 3-D) are right",
            ),
        ),
    ]
    nll = [
        case(Spec(op="nll_loss", masked=0.3)),
        case(Spec(op="nll_loss", reduction="sum", weight=True)),
        case(Spec(op="nll_loss", shape="bvs", reduction="none")),
    ]
    log_probs = [
        case(
            Spec(op="log_softmax"),
            xfail=KnownFailure(
                "log_softmax's backward inside loss_parallel is the identity (the fused cross-entropy backward "
                "does the real work), so any other use of the log-probabilities gets a wrong gradient without a word",
                checks=("grad:*",),
                reference=IDENTITY_BACKWARD,
            ),
        ),
    ]
    if not quick:
        ce += [
            case(Spec(weight=True, reduction="sum")),
            case(Spec(weight=True, reduction="none")),
            case(Spec(shape="bvh1", reduction="none")),  # 4-D with W = 1: right (the swap moves nothing)
            case(Spec(shape="v")),  # one sample [V]
            case(Spec(n=16, v=1000, s=4, shape="bsv-transpose", reduction="sum")),
        ]
    return ce + nll + log_probs + bad_input_cases()


def bad_input_cases() -> list[Case]:
    return [
        case(
            Spec(out_of_range=True),
            dtypes=("float64",),
            bad_input=BadInput(
                "target ids outside [0, V) other than ignore_index (single-device F.cross_entropy raises IndexError)"
            ),
            xfail=KnownFailure(
                "ids outside [0, V) are not refused: no rank owns them, so they count as a loss of 0 with the softmax "
                "as gradient (and, under mean, in the denominator)",
                checks=("property:bad_input",),
                reference=f"{LOSS_PY}, _nll_loss_forward: _MaskPartial masks an id outside every rank's piece to 0; "
                "nothing checks the range",
            ),
        ),
        case(
            Spec(probs=True),
            dtypes=("float64", "float32"),
            bad_input=BadInput(
                "class-probability targets (documented as not supported)",
                interpretation="F.cross_entropy with class-probability targets",
            ),
            xfail=KnownFailure(
                "class-probability targets: the loss is right, the gradient wrong without a word: the loss goes "
                "through log_softmax, whose backward inside loss_parallel is the identity",
                checks=("grad:*",),
                reference=IDENTITY_BACKWARD,
            ),
        ),
        case(
            Spec(label_smoothing=0.1),
            dtypes=("float64",),
            bad_input=BadInput(
                "label_smoothing > 0 (documented as not supported)",
                interpretation="F.cross_entropy's label-smoothed loss",
            ),
        ),
        case(
            Spec(mesh_2d=True),
            dtypes=("float64",),
            bad_input=BadInput(
                "reduction='mean' on a 2-D (dp, tp) mesh (documented as not supported)",
                interpretation="the mean over the whole batch",
            ),
        ),
        case(
            Spec(backward_outside=True),
            dtypes=("float64",),
            bad_input=BadInput(
                "the backward after the loss_parallel context has closed (documented: it must run inside)",
                interpretation="the gradient of the cross-entropy",
            ),
        ),
    ]


def bench_cases(quick: bool) -> list[Case]:
    """`shardcheck run --bench`: F.cross_entropy (mean) of N tokens over a vocabulary of 8,192 inside loss_parallel,
    forward and backward, in the CLI's dtype.  Sweep "n" at one rank; sweep "tp": one case at TP 1, 2 and 4."""

    def bench(sweep: str, n: int, supports) -> Case:
        spec = Spec(n=n, v=8192)
        return dataclasses.replace(
            case(spec),
            case_id=f"bench-{sweep}-n{n}v{spec.v}",
            params={**spec.params, "sweep": sweep},
            supports=supports,
        )

    tokens = (256, 1024) if quick else (512, 1024, 2048, 4096)
    return [bench("n", n, lambda t: t.size == 1) for n in tokens] + [bench("tp", 2048, lambda t: t.dp == t.cp == 1)]
