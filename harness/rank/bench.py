"""`shardcheck run --bench`: time, peak memory and collectives of one case on one rank.

Iteration count is the plan's (the same on every rank); each timed iteration starts after a
barrier over the sub-mesh, and the time recorded for it is the max over ranks.  Memory and
collectives come from separate, untimed iterations (their trackers cost time).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardcheck.harness.core.case import Case, as_tuple, is_float
from shardcheck.harness.core.layout import REPLICATED
from shardcheck.harness.core.measure import CommCounter, Timer, group_dims, peak_memory, split_comm
from shardcheck.harness.core.plan_data import DTYPES, Plan
from shardcheck.harness.core.rank_context import RankContext
from shardcheck.harness.core.records import Phase, Status
from shardcheck.harness.core.topology import mesh_dims
from shardcheck.harness.rank.item_run import ItemRun
from shardcheck.harness.rank.loaded_plan import LoadedPlan


def median_iqr(values) -> tuple[float, float]:
    t = torch.as_tensor(values, dtype=torch.float64)
    q1, median, q3 = (float(v) for v in torch.quantile(t, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)))
    return median, q3 - q1


@dataclass
class _Step:
    """One forward (+ backward) of the op on this rank's inputs, timed into the lists it is handed."""

    case: Case
    impl: object  # the module under test
    ctx: RankContext
    local: dict[str, torch.Tensor]  # this rank's pieces of the inputs
    timer: Timer
    grad_gen: torch.Generator
    upstream: list = field(default_factory=list)  # drawn once, never all ones

    def __call__(self, counter=None, fwd_times=None, bwd_times=None, backward=True) -> None:
        with self.ctx.contexts:  # what the case's run keeps open (a training step's CP context) ends with the step
            self._step(counter, fwd_times, bwd_times, backward)

    def _step(self, counter, fwd_times, bwd_times, backward) -> None:
        case = self.case
        xs = {k: v.detach().requires_grad_(k in case.grad_inputs) for k, v in self.local.items()}
        with self.timer(fwd_times if fwd_times is not None else []):
            outs = as_tuple(case.run(self.impl, self.ctx, xs))
        if not case.grad_inputs or not backward:
            return
        diff = [o for o in outs if is_float(o) and o.requires_grad]
        if not self.upstream:
            gen = self.grad_gen
            self.upstream.extend(torch.randn(o.shape, generator=gen, device=o.device, dtype=o.dtype) for o in diff)
        if counter is not None:
            counter.phase = Phase.BACKWARD
        with self.timer(bwd_times if bwd_times is not None else []):
            torch.autograd.backward(diff, self.upstream)


@dataclass
class _Measured:
    """What the bench's iterations measured on this rank (times: the max over the sub-mesh)."""

    counter: CommCounter
    peak_bytes_fwd: int
    peak_bytes: int
    times: torch.Tensor  # [iters, (forward, backward)] in ms


def run_bench_item(run: ItemRun) -> None:
    """Time, peak memory and collectives of forward (+ backward) on this rank's inputs.

    Iteration count is the plan's (the same on every rank); each iteration starts after a
    barrier over the sub-mesh; the recorded time of an iteration is the max over ranks."""
    loaded, item, case = run.loaded, run.item, run.case
    loaded.events.phase(item.id, Phase.FORWARD)
    step = _bench_step(run)
    try:
        measured = _iterate(step, loaded.plan, run.mesh, loaded.device)
    except Exception as exc:
        run.emit_error(item.checks, exc, Phase.FORWARD)
        return
    fields = _bench_fields(step, measured, loaded.plan)
    if run.topo.size == 1:  # the single-device reference on the same inputs, for the TP=1 overhead ratio
        fields.update(_bench_reference(loaded, case, step.local, step.timer))
    run.emit("bench", Status.PASS, **fields)
    run.emit_comm(step.ctx, measured.counter)


def _bench_step(run: ItemRun) -> _Step:
    """The step on this rank's pieces of the inputs, in a context whose model case drops each tensor it hands on."""
    loaded, item, case, mesh = run.loaded, run.item, run.case, run.mesh
    dtype = DTYPES[item.dtype]
    gen = torch.Generator().manual_seed(item.seed)
    full = {k: v.to(dtype) if is_float(v) else v for k, v in case.make_inputs(gen).items()}
    ctx = RankContext(
        mesh=mesh,
        topology=run.topo,
        device=loaded.device,
        dtype=dtype,
        full_shapes={k: tuple(v.shape) for k, v in full.items()},
        input_layouts=case.input_layouts,
        impl=loaded.impls[case.family],
        full_inputs={k: v for k, v in full.items() if not is_float(v)},  # what index rules read
        params=case.params,
        modules={fam: loaded.impls[fam] for fam in case.uses},
        # a model case's step hands each tensor on as it is made: the bench drops them (it times and
        # measures the step, not copies of every module's output kept for judging)
        judge_output=lambda name, tensor, layout: True,
    )
    local = {
        k: case.input_layouts.get(k, REPLICATED).local(v, mesh, full).clone().to(loaded.device) for k, v in full.items()
    }
    grad_gen = torch.Generator(device=loaded.device).manual_seed(item.seed + loaded.rank)
    return _Step(case, loaded.impls[case.family], ctx, local, Timer(loaded.device), grad_gen)


def _iterate(step: _Step, plan: Plan, mesh, device: torch.device) -> _Measured:
    """Warmup, one counted step, the peak memory of a forward and of a step, then the timed iterations."""
    for _ in range(plan.bench_warmup):
        step()
    counter = CommCounter(group_dims(mesh))
    with counter:
        step(counter)
    with peak_memory(device) as mem_fwd:
        step(backward=False)
    with peak_memory(device) as mem:
        step()
    fwd, bwd = [], []
    for _ in range(plan.bench_iters):
        _sync(mesh)
        step(fwd_times=fwd, bwd_times=bwd)
    times = torch.tensor([fwd, bwd or [0.0] * len(fwd)], dtype=torch.float64).T  # [iters, 2]
    for d in ("dp", "cp", "tp"):  # per-iteration max over the sub-mesh
        torch.distributed.all_reduce(times, op=torch.distributed.ReduceOp.MAX, group=mesh_dims(mesh).groups[d])
    return _Measured(counter, mem_fwd["peak_bytes"], mem["peak_bytes"], times)


def _bench_fields(step: _Step, m: _Measured, plan: Plan) -> dict:
    """The bench row's fields: times, peak memory, collectives, and the op's model of its own peak."""
    case, ctx, times = step.case, step.ctx, m.times
    total = times.sum(1)
    median, iqr = median_iqr(total)
    try:  # shared groups counted as the contract expects (CommCounter.as_dict); emit_comm judges the contract
        observed = m.counter.as_dict(case.comm(ctx) if case.comm else None)
    except Exception:
        observed = m.counter.as_dict()
    calls, nbytes = split_comm(observed)
    fields = dict(
        time_ms=median,
        time_ms_iqr=iqr,
        time_fwd_ms=float(times[:, 0].median()),
        time_bwd_ms=float(times[:, 1].median()),
        times_ms=[round(float(t), 4) for t in total],
        peak_bytes=m.peak_bytes,
        peak_bytes_fwd=m.peak_bytes_fwd,
        comm_calls=calls,
        comm_bytes=nbytes,
        iters=plan.bench_iters,
        warmup=plan.bench_warmup,
    )
    if case.memory is not None:  # the op's model of its own peak, beside the measured one
        try:
            model = case.memory(ctx)
            fields.update(
                expected_peak_bytes=int(model.peak_bytes), saved_bytes=int(model.saved_bytes), memory_model=model.terms
            )
        except Exception as exc:  # a broken model is the suite's bug: said in the row, the measurement kept
            fields.update(memory_model=f"memory model failed: {type(exc).__name__}: {exc}")
    return fields


def _bench_reference(loaded: LoadedPlan, case: Case, local: dict, timer: Timer) -> dict:
    """The single-device reference, forward and backward, on the same (full, TP=1) inputs."""
    upstream: list = []

    def step(times=None):
        xs = {k: v.detach().requires_grad_(k in case.grad_inputs) for k, v in local.items()}
        with timer(times if times is not None else []):
            outs = [o for o in as_tuple(case.reference(xs)) if is_float(o) and o.requires_grad]
            if case.grad_inputs and outs:
                if not upstream:
                    upstream.extend(torch.randn_like(o) for o in outs)
                torch.autograd.backward(outs, upstream)

    for _ in range(loaded.plan.bench_warmup):
        step()
    with peak_memory(loaded.device) as mem:
        step()
    times: list[float] = []
    for _ in range(loaded.plan.bench_iters):
        step(times)
    median, iqr = median_iqr(times)
    return {"ref_time_ms": median, "ref_time_ms_iqr": iqr, "ref_peak_bytes": mem["peak_bytes"]}


def _sync(mesh) -> None:
    """Barrier over the whole sub-mesh (dim by dim: afterwards every rank has entered)."""
    for d in ("dp", "cp", "tp"):
        torch.distributed.barrier(group=mesh_dims(mesh).groups[d])
