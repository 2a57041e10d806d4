"""Suite for nemo_automodel.components.distributed.utils: loss reduction, eval sharding, gradient
sync during accumulation, barriers, first rank per node, logging.

Two kinds of case.

Values, on the worker's ranks (DP topologies, tp = cp = 1; the ops take the mesh's DP group):
- `reduce_loss`: losses [L] and per-slice token counts sharded over DP; with `dp_group` every rank
  must hold the full-batch (loss, denominator), without it the DP ranks' results are `Partial`
  summands of it.  The denominator is compared exactly as an integer (counts past 2**31 included).
- `dp_eval_sample_shard`: every rank scores the samples its shard gives it; under DDP the DP
  ranks' score vectors must add up to every sample scored exactly once (`Partial`), under FSDP2 /
  Megatron-FSDP every rank must hold all scores (replicated).  Properties: the returned value, and
  coverage of range(n) for every n up to 2·DP + 1.
- `get_sync_ctx`: a real DDP or FSDP2 (`fully_shard`, gloo on CPU) MLP accumulates 3
  micro-batches; the accumulated gradient (gathered) must equal the single-device gradient of the
  full batch (forward check), and the collectives each micro-batch issued (counted per
  micro-batch) must show no gradient all-reduce / reduce-scatter before the optimizer step when
  sync is deferred, and one on every micro-batch when it is not.

Processes, in fresh ranks (`shardcheck.harness.core.processes.run_ranks`, from rank 0 of a size-1 topology): the
ops use the default (world) group, can abort the job or block, so they never run in the worker.
Each case starts its ranks (gloo on 127.0.0.1; 2 simulated nodes of 2 ranks where nodes matter),
records events with a global order, and turns exit codes, return values, events and log records
into `property:` checks (scenarios and judgements: suites/_distributed_utils_processes.py).  A rank still
running after PROCESS_DEADLINE_S is killed and reported.
The worker's --timeout must exceed PROCESS_DEADLINE_S (the default 60 s does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from shardcheck import (
    REPLICATED,
    BadInput,
    Case,
    FuzzSpace,
    Layout,
    OutsideSeed,
    Partial,
    Property,
    Shard,
    cite,
    ours,
    seed,
)
from shardcheck.harness.core.measure import CommCounter, group_dims
from shardcheck.harness.core.processes import module_ref, run_ranks
from shardcheck.reference import distributed_utils as ref
from shardcheck.suites._distributed_utils_processes import (
    BARRIER_TIMEOUT_S,
    BLOCK_S,
    PROCESS_DEADLINE_S,
    SLACK_S,
    STAGGER_S,
    barrier_log_scenario,
    first_rank_scenario,
    gloo_group_scenario,
    judge_barrier_log,
    judge_first_rank_order,
    judge_first_rank_raise,
    judge_gloo_group,
    judge_late_rank,
    judge_no_distributed,
    judge_subgroup_barrier,
    late_rank_scenario,
    raise_what_a_rank_raised,
    subgroup_barrier_scenario,
)
from shardcheck.suites._fuzz_draws import topology as fuzz_topology

FAMILY = "distributed_utils"
OP = FAMILY + "."
DOC = "docs/ops/distributed_utils.md"

DP_SHARDED = Layout(dp=Shard(0))
DP_SUM = Layout(dp=Partial())  # the full value is the sum of the DP ranks' values
GRAD_KINDS = ("all_reduce", "reduce_scatter")  # collectives that synchronise gradients


def _dp_only(topology) -> bool:
    return topology.tp == 1 and topology.cp == 1


# ---- reduce_loss ------------------------------------------------------------------------------

N_LOSSES = 16  # micro-batch losses over the whole DP group: one or more on every rank up to DP 16 (none: bad input)
N_SLICES = 4  # token counts: one per DP slice of the largest DP size
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class LossSpec:
    per_token: bool
    dp_group: bool
    big: bool = False  # token counts whose sum exceeds int32 (on every rank)
    n_losses: int = (
        N_LOSSES  # micro-batch losses over the DP group (torch.chunk sizes: uneven per rank when DP does not divide)
    )
    n_slices: int = N_SLICES  # token counts over the DP group (a rank may hold none: 0 tokens)

    @property
    def case_id(self) -> str:
        sizes = [] if (self.n_losses, self.n_slices) == (N_LOSSES, N_SLICES) else [f"l{self.n_losses}t{self.n_slices}"]
        return "-".join(
            [
                "per-token" if self.per_token else "per-loss",
                "dp-group" if self.dp_group else "local",
                *(["tokens-over-int32"] if self.big else []),
                *sizes,
            ]
        )


def _loss_inputs(spec: LossSpec):
    def make(gen: torch.Generator) -> dict[str, torch.Tensor]:
        losses = torch.rand(spec.n_losses, generator=gen, dtype=torch.float64) * 4 + 0.5
        if spec.big:  # each slice alone exceeds int32: so does every rank's count
            tokens = torch.randint(INT32_MAX + 1, 2 * INT32_MAX, (spec.n_slices,), generator=gen)
        else:
            tokens = torch.randint(1, 5000, (spec.n_slices,), generator=gen)
        return {"losses": losses, "num_tokens": tokens}

    return make


def _loss_run(spec: LossSpec):
    def run(impl, ctx, x):
        # Losses as they come out of a training step: attached to a graph (the result must not be).
        loss_store = list(x["losses"].clone().requires_grad_().unbind(0))
        total_num_tokens = x["num_tokens"].sum()  # this rank's count, a 0-d int64 tensor
        return impl.reduce_loss(
            loss_store,
            total_num_tokens,
            per_token_loss=spec.per_token,
            dp_group=ctx.group("dp") if spec.dp_group else None,
        )

    return run


def _count_check(summed_over_dp: bool):
    """The denominator: one integer (any integer dtype), exactly the expected count.  Without
    dp_group the DP ranks' counts are summed (in int64, every rank takes part)."""

    def check(got, expected, full, local, ctx):
        valid = (
            isinstance(got, torch.Tensor)
            and got.numel() == 1
            and not got.is_floating_point()
            and not got.is_complex()
            and got.dtype != torch.bool
        )
        total = got.detach().to("cpu", torch.int64).reshape(1).clone() if valid else torch.zeros(1, dtype=torch.int64)
        if summed_over_dp and ctx.size("dp") > 1:
            dist.all_reduce(total, group=ctx.group("dp"))
        if not valid:
            what = f"{got.dtype} of shape {tuple(got.shape)}" if isinstance(got, torch.Tensor) else type(got).__name__
            return False, f"denominator must be one integer, got {what}"
        want = int(expected.reshape(-1)[0])
        where = f"sum over {ctx.size('dp')} DP ranks of the denominators" if summed_over_dp else "denominator"
        return int(total) == want, f"{where} {int(total)} ({str(got.dtype)[6:]}), expected {want}"

    return check


def _detached(ctx, full, local, outs):
    loss, denominator = outs
    attached = [
        name
        for name, t in (("loss", loss), ("denominator", denominator))
        if isinstance(t, torch.Tensor) and t.requires_grad
    ]
    return [
        Property(
            "detached",
            not attached,
            None,
            f"{', '.join(attached)} still attached to the graph" if attached else "loss and denominator detached",
        )
    ]


def _loss_comm(spec: LossSpec):
    """With dp_group: one all-reduce of the [1] loss (float32 or better) and one of the [1] int64
    denominator; without: nothing."""

    def comm(ctx) -> dict:
        if not spec.dp_group:
            return {"forward": {}, "backward": {}}
        loss_bytes = torch.promote_types(ctx.dtype, torch.float32).itemsize
        return {"forward": {"all_reduce@dp": (2, loss_bytes + 8)}, "backward": {}}

    return comm


def loss_case(spec: LossSpec) -> Case:
    layout = REPLICATED if spec.dp_group else DP_SUM
    return Case(
        op=OP + "reduce_loss",
        case_id=spec.case_id,
        params={
            "per_token_loss": spec.per_token,
            "dp_group": spec.dp_group,
            "tokens_over_int32": spec.big,
            "n_losses": spec.n_losses,
            "n_token_slices": spec.n_slices,
        },
        make_inputs=_loss_inputs(spec),
        reference=lambda x, s=spec: ref.reduce_loss(x["losses"], x["num_tokens"], s.per_token),
        run=_loss_run(spec),
        input_layouts={"losses": DP_SHARDED, "num_tokens": DP_SHARDED},
        output_layouts=(layout, layout),
        output_names=("loss", "denominator"),
        output_checks={"denominator": _count_check(summed_over_dp=not spec.dp_group)},
        # Token slices may leave a DP rank none (it counts 0 tokens: fuzz found it); losses may not (an empty loss_store
        # is bad input, docs/ops/distributed_utils.md): a DP size that leaves a rank no loss is not planned.
        properties=_detached,
        comm=_loss_comm(spec),
        supports=lambda t: _dp_only(t) and min(_chunk_sizes(spec.n_losses, t.dp)) > 0,
        empty_pieces=("dp",),
        allows_float32="ours: docs/ops/distributed_utils.md#reduce_loss, the loss 'in float32 or better'",
    )


def _zero_loss(got, expected, full, local, ctx):
    """The loss of an empty loss_store: the empty sum, 0, as one float (float32 or better) detached."""
    ok = (
        isinstance(got, torch.Tensor)
        and got.numel() == 1
        and got.dtype in (torch.float32, torch.float64)
        and not got.requires_grad
        and float(got.reshape(-1)[0]) == 0.0
    )
    what = (
        f"{str(got.dtype)[6:]} {tuple(got.shape)} = {got.detach().reshape(-1).tolist()}"
        if isinstance(got, torch.Tensor)
        else type(got).__name__
    )
    return ok, f"got {what}, expected one float32/float64 0.0, detached"


def loss_bad_input_cases() -> list[Case]:
    def run_empty(impl, ctx, x):
        return impl.reduce_loss([], x["num_tokens"].sum(), dp_group=ctx.group("dp"))

    def run_float_count(impl, ctx, x):
        return impl.reduce_loss(
            list(x["losses"].unbind(0)), x["num_tokens"].sum().double() + 0.5, dp_group=ctx.group("dp")
        )

    common = dict(
        op=OP + "reduce_loss",
        make_inputs=_loss_inputs(LossSpec(True, True)),
        input_layouts={"losses": DP_SHARDED, "num_tokens": DP_SHARDED},
        dtypes=("float64",),
        supports=_dp_only,
    )
    return [
        Case(
            case_id="empty-loss-store",
            params={"loss_store": []},
            run=run_empty,
            # The sum of no losses is 0; the denominator is still the tokens' count, summed over DP.
            reference=lambda x: ref.reduce_loss(x["losses"][:0], x["num_tokens"], True),
            output_names=("loss", "denominator"),
            output_layouts=(REPLICATED, REPLICATED),
            output_checks={"loss": _zero_loss, "denominator": _count_check(summed_over_dp=False)},
            bad_input=BadInput(
                "an empty loss_store", interpretation="the empty sum: loss 0, the token count as denominator"
            ),
            **common,
        ),
        # The denominator is an integer count: no answer keeps both it and a fractional count.
        Case(
            case_id="fractional-token-count",
            params={"total_num_tokens": "float, n + 0.5"},
            run=run_float_count,
            reference=lambda x: (),
            bad_input=BadInput("a fractional token count (n + 0.5)"),
            **common,
        ),
    ]


# ---- dp_eval_sample_shard ---------------------------------------------------------------------

# The seed types the config `Any` and names its kinds only in words (DDP, FSDP2, MegatronFSDP): upstream's classes
# live in nemo_automodel.components.distributed.config, which is never imported here.  An op tells the strategies
# apart by the config's type, so the cases hand it the implementation's own class of that name when it defines or
# imports one (an `isinstance` against its own class must hold), and these stand-ins of the same names otherwise.


@dataclass(frozen=True)
class DDPConfig:
    """Stand-in of upstream's DDPConfig: data parallel, the full model on every rank."""


@dataclass(frozen=True)
class FSDP2Config:
    """Stand-in of upstream's FSDP2Config: parameters sharded over the DP ranks (`fully_shard`)."""


@dataclass(frozen=True)
class MegatronFSDPConfig:
    """Stand-in of upstream's MegatronFSDPConfig: parameters sharded over the DP ranks (Megatron-FSDP)."""


CONFIGS = {"ddp": DDPConfig, "fsdp2": FSDP2Config, "megatron-fsdp": MegatronFSDPConfig}


def config_class(impl, kind: str) -> type:
    """The config class the cases of `kind` hand `impl`: its own class of that name (defined or imported), else the
    stand-in."""
    standin = CONFIGS[kind]
    own = getattr(impl, standin.__name__, None)
    return own if isinstance(own, type) else standin


def _config(kind: str, impl):
    return config_class(impl, kind)()


def _expected_shard(kind: str, dp_rank: int, dp_size: int):
    return (dp_rank, dp_size) if kind == "ddp" and dp_size > 1 else None


def _scored_ids(shard, n: int) -> list[int]:
    """The samples of range(n) a rank scores: all of them without a shard, else rank::size."""
    if shard is None:
        return list(range(n))
    rank, size = shard
    return list(range(n))[rank::size]


def _eval_run(kind: str):
    def run(impl, ctx, x):
        values = x["values"]
        shard = impl.dp_eval_sample_shard(_config(kind, impl), ctx.rank("dp"), ctx.size("dp"))
        ids = torch.tensor(_scored_ids(shard, values.numel()), dtype=torch.long)
        scores = torch.zeros_like(values)
        scores[ids] = ref.score_samples(values[ids])
        return scores

    return run


def _eval_properties(kind: str):
    def properties(ctx, full, local, outs):
        impl, rank, size = ctx.impl, ctx.rank("dp"), ctx.size("dp")
        got = impl.dp_eval_sample_shard(_config(kind, impl), rank, size)
        want = _expected_shard(kind, rank, size)
        props = [
            Property(
                "returns", got == want, None, f"{kind} at DP rank {rank} of {size}: got {got!r}, expected {want!r}"
            )
        ]
        # Coverage for any N: the shards every DP rank gets, applied to range(n).
        shards = [impl.dp_eval_sample_shard(_config(kind, impl), r, size) for r in range(size)]
        per_sample = size if kind != "ddp" or size == 1 else 1  # sharded models: every rank scores everything
        bad = []
        for n in range(2 * size + 2):
            counts = [0] * n
            for shard in shards:
                for i in _scored_ids(shard, n):
                    counts[i] += 1
            if counts != [per_sample] * n:
                bad.append(f"N={n}: times scored {counts}")
        props.append(
            Property(
                "coverage",
                not bad,
                None,
                "; ".join(bad[:3])
                if bad
                else f"N = 0..{2 * size + 1}: every sample scored "
                f"{'exactly once' if per_sample == 1 else f'by all {size} ranks'}",
            )
        )
        return props

    return properties


def eval_case(kind: str, n: int) -> Case:
    return Case(
        op=OP + "dp_eval_sample_shard",
        case_id=f"{kind}-n{n}",
        params={"config": CONFIGS[kind].__name__, "n_samples": n},
        make_inputs=lambda gen: {"values": torch.randn(n, generator=gen, dtype=torch.float64)},
        reference=lambda x: ref.score_samples(x["values"]),
        run=_eval_run(kind),
        output_layouts=(DP_SUM if kind == "ddp" else REPLICATED,),
        output_names=("scores",),
        properties=_eval_properties(kind),
        dtypes=("float64",),
        supports=_dp_only,
    )


def eval_bad_input_cases() -> list[Case]:
    def rank_out_of_range(impl, ctx, x):
        return impl.dp_eval_sample_shard(_config("ddp", impl), ctx.size("dp"), ctx.size("dp"))

    def zero_size(impl, ctx, x):
        return (impl.dp_eval_sample_shard(_config("ddp", impl), 0, 0),)  # one output, whatever it is

    common = dict(op=OP + "dp_eval_sample_shard", make_inputs=lambda gen: {}, dtypes=("float64",), supports=_dp_only)
    return [
        Case(
            case_id="rank-equals-size",
            params={"dp_rank": "dp_size"},
            run=rank_out_of_range,
            reference=lambda x: (),
            bad_input=BadInput("a DP rank equal to the DP size (no such rank)"),
            **common,
        ),
        # The seed's rule gives a shard only for DDP with dp_size > 1: None (every rank scores everything).
        Case(
            case_id="size-zero",
            params={"dp_rank": 0, "dp_size": 0},
            run=zero_size,
            reference=lambda x: None,
            output_names=("shard",),
            bad_input=BadInput("a DP size of 0", interpretation="no shard below 2 ranks: None"),
            **common,
        ),
    ]


# ---- get_sync_ctx -----------------------------------------------------------------------------

MICRO_BATCHES, BATCH, FEATURES, HIDDEN, OUT = 3, 8, 6, 5, 2
MODEL_KINDS = ("ddp", "fsdp2-deferred", "fsdp2-every-step", "no-sync-wrapper", "plain")
# The seed names no wrapper; a data-parallel wrapper that is no DDP but has `no_sync()` (Megatron-FSDP's, as upstream's
# get_sync_ctx says since NVIDIA-NeMo/Automodel 147726c) skips its sync off the optimizer step under our rule.
NO_SYNC_WRAPPER = OutsideSeed(
    "a wrapper with no_sync() that is no DDP (the seed names no wrapper)", ours(f"{DOC}#no-sync-wrapper")
)


class NoSyncWrapper(torch.nn.Module):
    """A data-parallel wrapper that is not a `DistributedDataParallel` but exposes `no_sync()`, as Megatron-FSDP's
    does: the DDP it holds all-reduces the gradients, except inside `no_sync()`."""

    def __init__(self, module: torch.nn.Module, process_group):
        super().__init__()
        self.ddp = torch.nn.parallel.DistributedDataParallel(module, process_group=process_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ddp(x)

    def no_sync(self):
        return self.ddp.no_sync()


def _sync_inputs(micro_batches: int = MICRO_BATCHES, batch: int = BATCH):
    def make(gen: torch.Generator) -> dict[str, torch.Tensor]:
        def randn(*shape):
            return torch.randn(shape, generator=gen, dtype=torch.float64)

        return {
            "x": randn(micro_batches, batch, FEATURES),
            "y": randn(micro_batches, batch, OUT),
            "w1": randn(HIDDEN, FEATURES) * 0.5,
            "b1": randn(HIDDEN) * 0.1,
            "w2": randn(OUT, HIDDEN) * 0.5,
            "b2": randn(OUT) * 0.1,
        }

    return make


def _model(x: dict, dtype: torch.dtype) -> torch.nn.Sequential:
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))
    model.to(x["w1"].device, dtype)  # the rank's device (its GPU on a CUDA run), as DDP and fully_shard expect
    with torch.no_grad():
        for param, name in zip(model.parameters(), ("w1", "b1", "w2", "b2")):
            param.copy_(x[name])
    return model


def _sync_run(kind: str):
    def run(impl, ctx, x):
        model = _model(x, ctx.dtype)
        dp = ctx.size("dp")
        if kind == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model, process_group=ctx.group("dp"))
        elif kind == "no-sync-wrapper":
            model = NoSyncWrapper(model, ctx.group("dp"))
        elif kind.startswith("fsdp2"):
            from torch.distributed.fsdp import fully_shard

            fully_shard(model[0], mesh=ctx.mesh["dp"])
            fully_shard(model[2], mesh=ctx.mesh["dp"])
            fully_shard(model, mesh=ctx.mesh["dp"])
        defer = kind != "fsdp2-every-step"
        # DDP and FSDP2 average gradients over DP; a plain model's DP ranks are summands (DP_SUM), so
        # each takes 1/DP of the mean over its rows.
        scale = 1.0 / dp if kind == "plain" else 1.0
        per_micro_batch = []
        micro_batches = x["x"].shape[0]
        for m in range(micro_batches):
            counter = CommCounter(group_dims(ctx.mesh))
            with counter, impl.get_sync_ctx(model, m == micro_batches - 1, defer):
                loss = ((model(x["x"][m]) - x["y"][m]) ** 2).mean() * scale
                loss.backward()
            per_micro_batch.append(counter.as_dict().get("forward", {}))
        grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads]).detach()
        # What each micro-batch communicated, for _sync_properties (the harness passes the outputs on).
        flat.collectives_per_micro_batch = per_micro_batch
        return flat

    return run


def _grad_syncs(collectives: dict) -> int:
    return sum(v["calls"] for k, v in collectives.items() if k.split("@")[0] in GRAD_KINDS)


def _sync_properties(kind: str):
    def properties(ctx, full, local, outs):
        per_mb = outs[0].collectives_per_micro_batch
        syncs = [_grad_syncs(c) for c in per_mb]
        seen = "; ".join(f"micro-batch {m + 1}: {c or 'nothing'}" for m, c in enumerate(per_mb))
        dp = ctx.size("dp")
        if kind == "plain":
            calls = [sum(v["calls"] for v in c.values()) for c in per_mb]
            return [Property("no_collectives", not any(calls), None, seen)]
        if kind == "fsdp2-every-step":
            if dp == 1:
                return []
            return [Property("grad_sync_every_micro_batch", all(syncs), None, seen)]
        props = [Property("no_grad_sync_before_optim_step", not any(syncs[:-1]), None, seen)]
        if dp > 1:
            props.append(Property("grad_sync_on_optim_step", syncs[-1] > 0, None, seen))
        return props

    return properties


def sync_case(kind: str, micro_batches: int = MICRO_BATCHES, batch: int = BATCH) -> Case:
    return Case(
        op=OP + "get_sync_ctx",
        case_id=f"{kind}-{micro_batches}-micro-batches" + (f"-b{batch}" if batch != BATCH else ""),
        params={
            "model": kind,
            "micro_batches": micro_batches,
            "batch": batch,
            "defer_fsdp_grad_sync": kind != "fsdp2-every-step",
        },
        make_inputs=_sync_inputs(micro_batches, batch),
        reference=lambda x: ref.accumulated_gradients(x["x"], x["y"], x["w1"], x["b1"], x["w2"], x["b2"]),
        run=_sync_run(kind),
        input_layouts={"x": Layout(dp=Shard(1)), "y": Layout(dp=Shard(1))},
        output_layouts=(DP_SUM if kind == "plain" else REPLICATED,),
        output_names=("grads",),
        properties=_sync_properties(kind),
        dtypes=("float64", "float32"),
        supports=lambda t: _dp_only(t) and batch % t.dp == 0,
        outside_seed=(NO_SYNC_WRAPPER,) if kind == "no-sync-wrapper" else (),
    )


def _process_case(
    op: str, case_id: str, run, properties, params: dict, ends: bool = True, skip_reason: str | None = None
) -> Case:
    """`ends`: its properties include property:ranks_end (every rank ends by itself), cited per op (RANKS_END)."""
    return Case(
        op=OP + op,
        case_id=case_id,
        params=params,
        make_inputs=lambda gen: {},
        reference=lambda x: (),
        run=run,
        output_layouts=(),
        output_names=(),
        properties=lambda ctx, full, local, outs: properties(outs[0]),
        dtypes=("float64",),
        supports=lambda t: t.size == 1,
        rules={"property:ranks_end": RANKS_END[op]} if ends else {},
        skip_reason=skip_reason,
    )


def _gpus_short_of(fresh_ranks: int) -> str | None:
    """Why a case whose op makes its own process group on `fresh_ranks` fresh ranks cannot run on this machine:
    where CUDA is there the op picks NCCL, which needs a GPU per rank (fewer fail with NCCL's "invalid usage")."""
    if not torch.cuda.is_available() or torch.cuda.device_count() >= fresh_ranks:
        return None
    gpus = torch.cuda.device_count()
    return f"the op's own NCCL group needs a GPU per fresh rank ({fresh_ranks}); this machine has {gpus}"


# node 1's first rank (its node-mate waits in the barrier for it), and rank 0, node 0's: code that handles rank 0's
# exception alone (a historical `quit(1)` when rank 0 raises, which loses the exception) shows only there
RAISING_RANKS = (2, 0)


def process_cases() -> list[Case]:
    def first_rank_nodes(impl, ctx, x):
        run = run_ranks(first_rank_scenario, 4, nodes=2, args=(module_ref(impl), -1), deadline=PROCESS_DEADLINE_S)
        return raise_what_a_rank_raised(run, getattr(impl, "__file__", None))

    def first_rank_raises(raising_rank: int):
        return lambda impl, ctx, x: run_ranks(
            first_rank_scenario,
            4,
            nodes=2,
            args=(module_ref(impl), raising_rank),
            init_process_group=True,
            deadline=PROCESS_DEADLINE_S,
        )

    def first_rank_single(impl, ctx, x):
        run = run_ranks(
            first_rank_scenario, 1, args=(module_ref(impl), -1), distributed_env=False, deadline=PROCESS_DEADLINE_S
        )
        return raise_what_a_rank_raised(run, getattr(impl, "__file__", None))

    def late_rank(impl, ctx, x):
        return run_ranks(
            late_rank_scenario, 3, args=(module_ref(impl),), init_process_group=True, deadline=PROCESS_DEADLINE_S
        )

    def subgroup_barrier(impl, ctx, x):
        return run_ranks(
            subgroup_barrier_scenario, 3, args=(module_ref(impl),), init_process_group=True, deadline=PROCESS_DEADLINE_S
        )

    def gloo_group(impl, ctx, x):
        return {
            "world": run_ranks(
                gloo_group_scenario, 3, args=(module_ref(impl),), init_process_group=True, deadline=PROCESS_DEADLINE_S
            ),
            "single": run_ranks(
                gloo_group_scenario, 1, args=(module_ref(impl),), distributed_env=False, deadline=PROCESS_DEADLINE_S
            ),
        }

    def barrier_log(impl, ctx, x):
        return {
            "world": run_ranks(
                barrier_log_scenario, 3, args=(module_ref(impl),), init_process_group=True, deadline=PROCESS_DEADLINE_S
            ),
            "single": run_ranks(
                barrier_log_scenario, 1, args=(module_ref(impl),), distributed_env=False, deadline=PROCESS_DEADLINE_S
            ),
        }

    nodes = {"world_size": 4, "nodes": 2, "deadline_s": PROCESS_DEADLINE_S}
    return [
        _process_case(
            "FirstRankPerNode",
            "2-nodes-of-2",
            first_rank_nodes,
            judge_first_rank_order,
            {**nodes, "block_s": BLOCK_S, "process_group": "created by the op", "raises": "no rank"},
            skip_reason=_gpus_short_of(nodes["world_size"]),
        ),
        *[
            _process_case(
                "FirstRankPerNode",
                f"raises-on-rank-{rank}",
                first_rank_raises(rank),
                lambda run, rank=rank: judge_first_rank_raise(run, rank),
                # words, not a number: a bug of node 1's first rank shows "with raises ≠ rank 0" (findings)
                {**nodes, "raises": f"rank {rank}"},
                ends=False,
            )
            for rank in RAISING_RANKS
        ],
        _process_case(
            "FirstRankPerNode", "no-distributed", first_rank_single, judge_no_distributed, {"world_size": 1}, ends=False
        ),
        _process_case(
            "_barrier_with_timeout",
            "late-rank",
            late_rank,
            judge_late_rank,
            {
                "world_size": 3,
                "timeout_s": BARRIER_TIMEOUT_S,
                "slack_s": SLACK_S,
                "late_rank": "arrives after the others returned",
                "deadline_s": PROCESS_DEADLINE_S,
            },
        ),
        _process_case(
            "_barrier_with_timeout",
            "group-of-2-in-3",
            subgroup_barrier,
            judge_subgroup_barrier,
            {"world_size": 3, "group": "ranks 0, 1 (rank 2 does not call)", "deadline_s": PROCESS_DEADLINE_S},
            ends=False,  # group_members_true says whether its ranks end: the barrier is the scenario's only step
        ),
        _process_case("_create_gloo_group", "all-ranks", gloo_group, judge_gloo_group, {"world_size": 3}),
        _process_case(
            "barrier_and_log",
            "staggered-arrivals",
            barrier_log,
            judge_barrier_log,
            {"world_size": 3, "stagger_s": STAGGER_S},
        ),
    ]


# ---- the case matrix ----------------------------------------------------------------------------


def cases(quick: bool = False) -> list[Case]:
    loss_specs = [
        LossSpec(True, True),
        LossSpec(True, False),
        LossSpec(False, True),
        LossSpec(False, False),
        LossSpec(True, True, big=True),
        LossSpec(True, False, big=True),
    ]
    if quick:
        loss_specs = [LossSpec(True, True, big=True), LossSpec(False, False)]
    sizes = (3, 7) if quick else (1, 3, 7, 8)
    out = [loss_case(s) for s in loss_specs] + loss_bad_input_cases()[: 1 if quick else None]
    out += [eval_case(kind, n) for kind in CONFIGS for n in sizes] + eval_bad_input_cases()[: 1 if quick else None]
    out += [sync_case(kind) for kind in MODEL_KINDS]
    # input the seed does not describe (an empty loss_store, a fractional count, a DP rank or size out of range)
    return cite(out + process_cases(), RULES, bad_input=ours(f"{DOC}#reduce_loss"))


_FIRST = "FirstRankPerNode: "
_BARRIER = "_barrier_with_timeout: 'Returns: True if barrier completed successfully, False if timeout occurred'"
_LOG = "barrier_and_log: 'Perform a distributed barrier and then log a message on rank 0.'"
# Every rank of a process case ends by itself: a rank that never returns (or dies) returns nothing the seed documents
# for its op.  The sentence each op's return rests on (docs/ops/distributed_utils.md#rules-seed-or-ours, per case).
RANKS_END = {
    "FirstRankPerNode": seed(
        "FirstRankPerNode.__exit__: 'If the current process was the first on its node, release "
        "the waiting peer ranks by issuing a barrier.'"
    ),
    "_barrier_with_timeout": seed(
        "_barrier_with_timeout: 'A timeout wrapper for torch.distributed.barrier()'; "
        "'Returns: True if barrier completed successfully, False if timeout occurred'"
    ),
    "_create_gloo_group": seed("_create_gloo_group: 'Returns: Gloo process group for barriers'"),
    "barrier_and_log": seed(_LOG),
}
# Where each property's rule comes from (docs/ops/distributed_utils.md#rules-seed-or-ours lists them).
RULES = {
    "property:detached": ours(f"{DOC}#reduce_loss"),
    "property:returns": seed(
        "dp_eval_sample_shard: 'Return (dp_rank, dp_size) to shard eval samples across DP ranks, else None.'"
    ),
    "property:coverage": seed(
        "dp_eval_sample_shard: 'Only DDP replicates the full model on every rank, so only there "
        "can each rank score a disjoint subset independently.'"
    ),
    "property:no_collectives": ours(f"{DOC}#get_sync_ctx"),
    "property:grad_sync_every_micro_batch": seed("get_sync_ctx: 'False: always sync gradients on every micro-batch'"),
    "property:no_grad_sync_before_optim_step": seed(
        "get_sync_ctx: 'True: disable gradient sync on non-final micro-batches'"
    ),
    "property:grad_sync_on_optim_step": seed("get_sync_ctx: 'Whether the current step is an optimizer step.'"),
    "property:first_rank_per_node_true": seed(_FIRST + "'Returns: True - if the current process is node-rank-0'"),
    "property:others_enter_after_first_left": seed(
        _FIRST + "'Lets RANK==0 run the protected code first on each node.'"
    ),
    "property:own_process_group_destroyed": seed(
        _FIRST + "'If this context manager created the process group, destroy it.'"
    ),
    "property:exception_ends_every_rank": seed(
        _FIRST + "'If an exception occurred, abort the entire distributed job.'"
    ),
    "property:error_names_rank": ours(f"{DOC}#firstrankpernode"),
    "property:single_process_true": seed(
        _FIRST + "'Works on a single GPU (no env flags, no distributed initialisation).'"
    ),
    "property:on_time_true": seed(_BARRIER),
    "property:waiting_ranks_false_within_timeout": seed(_BARRIER),
    "property:late_rank_false": seed(_BARRIER),
    # the barrier's own group times out; the training group it keeps apart must still work, and a timed-out
    # barrier returns False (the caller goes on): the next one, reached by every rank, completes
    "property:groups_work_after": seed(
        "_barrier_with_timeout: 'This approach creates a separate Gloo process group for "
        "barrier operations while keeping the main NCCL backend for training "
        "operations.'; 'Returns: True if barrier completed successfully, False if "
        "timeout occurred'"
    ),
    # a group of some ranks: only its members take part (a model-local group's caller); the historical copy that
    # barriered a new gloo group over all ranks whatever `group` was hung its members (issue 42, pre-fix copies)
    "property:group_members_true": seed(
        "_barrier_with_timeout: 'group: Process group for the barrier operation'; "
        "'Returns: True if barrier completed successfully, False if timeout occurred'"
    ),
    "property:gloo_group_over_all_ranks": seed(
        "_create_gloo_group: 'Create a Gloo process group for barrier operations.'"
    ),
    "property:none_without_distributed": ours(f"{DOC}#_create_gloo_group"),
    "property:one_record_from_rank_0": seed(_LOG),
    "property:logged_after_every_rank_arrived": seed(_LOG),
    "property:every_rank_waits": seed(_LOG),
    "property:single_process_logs_once": ours(f"{DOC}#barrier_and_log"),
}


# ---- fuzz spaces (`shardcheck fuzz`) -----------------------------------------------------------------
#
# The value ops only.  The process-level ops (FirstRankPerNode, _barrier_with_timeout, _create_gloo_group,
# barrier_and_log) have no parameter space: their cases are fixed scenarios on fresh ranks (ordering, deadlines,
# exits), whose only sizes are the world and node counts of the scenario itself.


def _chunk_sizes(n: int, parts: int) -> list[int]:
    """torch.chunk sizes of n items over `parts` ranks (the Shard layout): trailing ranks may get fewer, or none."""
    size = -(-n // parts) if n else 0
    return [max(0, min(size, n - r * size)) for r in range(parts)]


def _reduce_loss_params(topologies):
    """Uneven micro-batch counts per DP rank (never none: an empty loss_store is bad input), uneven token slices
    (a rank may count 0 tokens), counts past int32, with and without dp_group."""
    from hypothesis import strategies as st

    @st.composite
    def params(draw):
        topology = draw(fuzz_topology(topologies, cp=True, legal=_dp_only))
        dp = topology[0]
        n_losses = draw(st.integers(dp, 3 * dp + 3).filter(lambda n: min(_chunk_sizes(n, dp)) > 0))
        return {
            "topology": topology,
            "dtype": draw(st.sampled_from(["float64", "float32", "bfloat16"])),
            "per_token_loss": draw(st.booleans()),
            "dp_group": draw(st.booleans()),
            "n_losses": n_losses,
            "n_token_slices": draw(st.integers(1, 2 * dp + 3)),
            "tokens_over_int32": draw(st.booleans()),
        }

    return params()


def _reduce_loss_case(p: dict) -> Case:
    return loss_case(
        LossSpec(p["per_token_loss"], p["dp_group"], p["tokens_over_int32"], p["n_losses"], p["n_token_slices"])
    )


def _eval_shard_params(topologies):
    """Every config kind on every sample count up to past 2·DP (the coverage property checks every N up to 2·DP + 1)."""
    from hypothesis import strategies as st

    return st.fixed_dictionaries(
        {
            "topology": fuzz_topology(topologies, cp=True, legal=_dp_only),
            "dtype": st.just("float64"),
            "config": st.sampled_from(list(CONFIGS)),
            "n_samples": st.integers(1, 13),
        }
    )


def _sync_params(topologies):
    """DDP, FSDP2 with and without deferral, a plain model; 1 to 4 micro-batches (1: every step is the optimizer
    step), the local batch 1 to 3 rows."""
    from hypothesis import strategies as st

    @st.composite
    def params(draw):
        topology = draw(fuzz_topology(topologies, cp=True, legal=_dp_only))
        return {
            "topology": topology,
            "dtype": draw(st.sampled_from(["float64", "float32"])),
            "model": draw(st.sampled_from(list(MODEL_KINDS))),
            "micro_batches": draw(st.integers(1, 4)),
            "batch": topology[0] * draw(st.integers(1, 3)),
        }

    return params()


def fuzz_spaces() -> list[FuzzSpace]:
    return [
        FuzzSpace(OP + "reduce_loss", _reduce_loss_params, _reduce_loss_case),
        FuzzSpace(OP + "dp_eval_sample_shard", _eval_shard_params, lambda p: eval_case(p["config"], p["n_samples"])),
        FuzzSpace(OP + "get_sync_ctx", _sync_params, lambda p: sync_case(p["model"], p["micro_batches"], p["batch"])),
    ]
