"""Worker: one process per rank; runs the items of one plan after another.

    python -m shardcheck.harness.rank.worker --launch-dir DIR ...          # started by the driver (shardcheck.harness.driver.launch), RANK/WORLD_SIZE set
    torchrun --nnodes 2 ... -m shardcheck.harness.standalone --suite model_utils --out shardcheck-runs/x   # by hand

Started by the driver, the ranks rendezvous first (rank 0 hosts the store on a free port and writes it to
DIR/store-port), then wait for DIR/plan0.json, run it, wait for DIR/plan1.json, and so on: a launch is started
before its plan is known and serves every plan of its world size (`shardcheck fuzz` sends one per example).  Each
rank appends its events of plan k (start, phase, check, error, done) to DIR/plan<k>/rank<R>.jsonl; the driver
merges them into result rows.  When started by hand, rank 0 does the merging itself (the out dir must then be on
a filesystem all nodes share).

Never hang: after each item every rank checks in at a store barrier.  If a peer does not arrive within the plan's
timeout (it skipped a collective, or is blocked in one, or died) the ranks that did arrive record who is missing
and exit; the driver ends the launch and relaunches for the remaining items.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import faulthandler
import itertools
import math
import os
import signal
import sys
import sysconfig
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import shardcheck.harness
import shardcheck.reference
import shardcheck.suites
from shardcheck.harness.core.bad_input import BAD_INPUT_CHECK
from shardcheck.harness.core.case import Case, as_tuple, is_float
from shardcheck.harness.core.compare import BudgetScope, budget, compare, judge
from shardcheck.harness.core.events import EXIT_PEER_STUCK, PIECES, STOP, Events, events_path, stack_path
from shardcheck.harness.core.layout import REPLICATED
from shardcheck.harness.core.measure import CommCounter, comm_violations, group_dims, split_comm
from shardcheck.harness.core.model_case import StepCase, step_order
from shardcheck.harness.core.peer_failure import is_peer_failure
from shardcheck.harness.core.plan_data import DTYPES, Item, Plan
from shardcheck.harness.core.rank_context import RankContext
from shardcheck.harness.core.records import SIGNATURE_CHECK, Phase, Status, Symptom
from shardcheck.harness.core.rules import is_ours, under_rule
from shardcheck.harness.core.topology import Topology, build_mesh, mesh_coords, mesh_dims
from shardcheck.harness.rank import flight_recorder, shims
from shardcheck.harness.rank.artefacts import MAX_NUMEL as MAX_ARTEFACT_NUMEL
from shardcheck.harness.rank.bench import run_bench_item
from shardcheck.harness.rank.fuzz_cases import fuzz_case
from shardcheck.harness.rank.signatures import under_test, used_by_one_case, used_drift
from shardcheck.harness.rank.suite_loader import suite_cases, suite_fuzz_spaces
from shardcheck.reference import low_precision_math

STUCK_LINGER = 5.0  # seconds a rank that found a peer missing stays up, so the driver takes every rank's stack first
RAISED_GRACE = 10.0  # seconds the ranks at an item's barrier still wait for their peers once one of them raised
BARRIER_SLICE = 1.0  # how often a rank waiting at the barrier looks whether a peer raised


def _detach(t):
    return t.detach() if isinstance(t, torch.Tensor) else t  # an output may legitimately be None


@dataclass
class _Call:
    """What one item's steps hand each other on this rank."""

    item: Item
    case: Case
    impl: object  # the module under test
    mesh: object
    ctx: RankContext
    golden: Golden
    local: dict[str, torch.Tensor]  # this rank's pieces of the inputs
    counter: CommCounter
    emit_check: Callable
    contexts: contextlib.ExitStack
    # Outputs judged as the run made them (RankContext.judge_output): {output index: verdict}, emitted in output order
    # after the run; the first exception the harness raised judging one, with its output's index (raised when the
    # judging after the run reaches that output, as it would have raised judging it there).
    verdicts: dict[int, _Verdict] = field(default_factory=dict)
    arrival_error: tuple[int, Exception] | None = None


@dataclass
class _Verdict:
    """One local tensor judged against its slice of the golden, before the precision step: what its row needs, and
    what that step needs (the tensors themselves only where it compares them elementwise: per-row budgets)."""

    check: str
    stats: dict
    status: Status
    ratio: float
    message: str
    symptom: Symptom | None
    got_dtype: torch.dtype
    expect_dtype: torch.dtype
    gold_full: torch.Tensor  # the golden's own tensor, not a copy
    lay: object  # Layout
    got: torch.Tensor | None
    expected: torch.Tensor | None
    piece: dict | None  # its failure artefact piece, when kept


class Golden:
    """Full inputs in the item's dtype, the float64 golden outputs and gradients, and the
    reference run in the item's dtype (for the low-precision budget).  Same on every rank."""

    def __init__(self, case: Case, dtype: torch.dtype, seed: int, n_summands: int):
        gen = torch.Generator().manual_seed(seed)
        raw = case.make_inputs(gen)
        # Low-precision inputs are the float64 ones rounded; the golden sees the rounded values,
        # so input rounding is not counted as error.
        self.inputs = {k: v.to(dtype) if is_float(v) else v for k, v in raw.items()}
        self.upstream: list[torch.Tensor | None] = []
        self.case, self.n_summands = case, n_summands
        self._precision_runs: dict[str, tuple] = {}
        if case.bad_input is not None and case.bad_input.interpretation is None:  # no answer to compare against
            self.outputs = self.naive_outputs = ()
            self.grads = self.naive_grads = {}
            return
        self.outputs, self.grads = self._reference(
            case, {k: v.double() if is_float(v) else v for k, v in self.inputs.items()}, gen, n_summands
        )
        if dtype == torch.float64:
            self.naive_outputs, self.naive_grads = self.outputs, self.grads
        else:
            self.naive_outputs, self.naive_grads = self._reference(case, self.inputs, None, n_summands)

    def precision_run(self, kind: str) -> tuple[tuple, dict]:
        """(outputs, grads) of the reference as code with a legitimate precision difference computes
        them: "float32" on the inputs rounded to float32 (for a float64 item), "bfloat16 math" in the
        item's dtype without the float32 upcast (shardcheck.reference.low_precision_math).  Only run when a check
        fails, once per item."""
        if kind not in self._precision_runs:
            self._precision_runs[kind] = self._precision(kind)
        return self._precision_runs[kind]

    def precision_limits(self, kind: str, dtype: torch.dtype) -> tuple[tuple, dict]:
        """(outputs, {}) as precision_run gives them, each output reduced to its tensor-wide budget in `dtype` (one
        number: BudgetScope.TENSOR) against that run: a model case's precision step needs no more, and the run (every
        module's tensors of the step) is not kept."""
        key = f"{kind} limits"
        if key not in self._precision_runs:
            outs = (self._precision_runs.get(kind) or self._precision(kind))[0]
            limits = []
            for gold, alt in zip(self.outputs, outs):
                b = budget(gold, alt, dtype, BudgetScope.TENSOR)[0] if gold is not None and alt is not None else None
                limits.append(None if b is None else float(b.reshape(-1)[0]) if b.numel() else 0.0)
            self._precision_runs[key] = (tuple(limits), {})
        return self._precision_runs[key]

    def _precision(self, kind: str) -> tuple[tuple, dict]:
        if kind == "float32":
            inputs = {k: v.float() if is_float(v) else v for k, v in self.inputs.items()}
            return self._reference(self.case, inputs, None, self.n_summands)
        with low_precision_math():
            return self._reference(self.case, self.inputs, None, self.n_summands)

    def _reference(self, case: Case, inputs: dict, gen, n_summands: int):
        inputs = {k: v.clone().requires_grad_(k in case.grad_inputs) for k, v in inputs.items()}
        with torch.enable_grad():
            outs = as_tuple(case.reference(inputs))
        if not case.grad_inputs:
            return tuple(_detach(o) for o in outs), {}
        if gen is not None:  # first (float64) pass draws the upstream gradients; never all ones
            for o in outs:
                if is_float(o) and o.requires_grad:
                    g = torch.randn((n_summands, *o.shape), generator=gen, dtype=torch.float64)
                    g[:, ~torch.isfinite(o.detach())] = 0.0  # no gradient flows from -inf/NaN outputs
                    self.upstream.append(g)
                else:
                    self.upstream.append(None)
        xs = [inputs[n] for n in case.grad_inputs]
        used = [(o, g) for o, g in zip(outs, self.upstream) if g is not None]
        # The golden backpropagates the summed upstream once.  A low-precision run backpropagates each
        # summand's upstream and adds the gradients in its dtype, as the ranks do (each rank's output is
        # its own summand): its error then includes the rounding of the summands, which can be larger
        # than their sum (CP ranks' gradients cancel), and the budget follows.
        summands = [None] if gen is not None else range(n_summands)
        total = [None] * len(xs)
        for s in summands:
            ups = [(g.sum(0) if s is None else g[s]).to(o.dtype) for o, g in used]
            grads = torch.autograd.grad([o for o, _ in used], xs, ups, allow_unused=True, retain_graph=s is not None)
            total = [g if t is None else (t if g is None else t + g) for t, g in zip(total, grads)]
        grads = {
            n: (g if g is not None else torch.zeros_like(x)).detach() for n, x, g in zip(case.grad_inputs, xs, total)
        }
        return tuple(_detach(o) for o in outs), grads


class Worker:
    """One rank: its process group, kept for every plan it runs (`load` one, then `run` it)."""

    def __init__(
        self,
        device: str,
        backend: str,
        timeout: float,
        use_shims: bool,
        store: dist.Store | None = None,
        rank: int | None = None,
        world: int | None = None,
    ):
        self.device = torch.device(device)
        self.backend = backend
        if self.device.type == "cuda":
            # nccl: one GPU per rank; gloo on a shared GPU: ranks share device 0 (or wrap around)
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
            self.device = torch.device("cuda", torch.cuda.current_device())
        pg_timeout = timedelta(seconds=timeout + 120)
        if store is None:  # torchrun's environment
            dist.init_process_group(backend, timeout=pg_timeout)
        else:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=pg_timeout)
        if use_shims:  # before any module under test runs
            shims.install(self.device.type)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.meshes = {}
        self.plans_loaded = 0
        self.budget_scope = BudgetScope.ROW  # of the item being judged (Case.budget_scope)
        self.events = None
        self.recorder = None  # the collective flight recorder (harness/rank/flight_recorder.py), when serving a driver
        self.linger_on_stuck = 0.0  # (the driver's ranks: STUCK_LINGER)
        # A hand-launched rank (harness/standalone.py) has no driver to ask for its stack: it dumps it itself, into
        # this file, when an item is still running at --timeout (faulthandler's own timer thread, answered while
        # the rank spins or blocks in C++).
        self.dump_stacks_to = None
        self.current: tuple[Item, float] | None = None  # (the item in flight, its start): a watchdog thread reads it

    def load(self, plan: Plan, events_dir: Path) -> None:
        """Make `plan` the one `run` runs; its events go to `events_dir`."""
        self.plan = plan
        # Item ids start at 0 in every plan: each plan checks in under keys of its own.
        self.store = dist.PrefixStore(
            f"shardcheck-items/{self.plans_loaded}", dist.distributed_c10d._get_default_store()
        )
        self.plans_loaded += 1
        if self.events is not None:
            self.events.file.close()
        self.events = Events(events_path(events_dir, self.rank), self.rank)
        self.cases: dict[tuple[str, str], Case] = {}
        for suite in sorted({i.suite for i in plan.items if i.fuzz is None}):
            self.cases.update(
                {(c.op, c.case_id): c for c in suite_cases(suite, plan.quick, plan.bench, plan.suite_paths)}
            )
        for item in plan.items:  # fuzz cases: rebuilt from their drawn params
            if item.fuzz is not None:
                space = suite_fuzz_spaces(item.suite, plan.suite_paths)[item.op]
                self.cases[(item.op, item.case_id)] = fuzz_case(space, item.fuzz)
        # someone else's module: its ops are called by the seed's parameter names (harness/rank/signatures.py)
        self.impls = {fam: under_test(fam, spec, plan.default_impl.get(fam)) for fam, spec in plan.impl.items()}
        # the ops with a signature row of their own in this plan (harness/driver/run.py): a used family's drift of
        # one of them is not repeated on a model case's row (_emit_used_signatures)
        self.ops_with_signature_rows = {i.op for i in plan.items} | set(plan.missing_ops)
        self._golden_key, self._golden = None, None
        self.events_dir = events_dir
        self.pieces: dict[str, dict] = {}  # this item's compared tensors, kept for failure artefacts
        self.failures_saved = 0

    def mesh(self, topo: Topology):
        if topo not in self.meshes:
            self.meshes[topo] = build_mesh(topo, self.world, self.device.type)
        return self.meshes[topo]

    def golden(self, case: Case, item: Item, n_summands: int) -> Golden:
        key = (case.op, case.case_id, item.dtype, item.seed, n_summands)
        if key != self._golden_key:  # items come grouped by case and dtype
            self._golden_key, self._golden = key, Golden(case, DTYPES[item.dtype], item.seed, n_summands)
        return self._golden

    def run(self, on_item_done=None, on_stuck=None) -> None:
        for item in self.plan.items:
            if item.world_size != self.world:
                continue
            started = time.time()
            self.current = (item, started)
            self.events.started(item.id)
            if self.dump_stacks_to is not None:
                faulthandler.dump_traceback_later(self.plan.timeout, file=self.dump_stacks_to)
            topo = Topology(*item.topology)
            mesh = self.mesh(topo)
            if self.recorder is not None:
                self.recorder.begin_item(self.plans_loaded - 1, item.id, group_dims(mesh))
            # the planner's reason (the case's shapes cannot be laid out at this topology) or the case's own
            skip_reason = item.skip or self.cases[(item.op, item.case_id)].skip_reason
            self._emitted: set[str] = set()  # the checks this rank reported for the item
            self._phase = Phase.SETUP
            if self.rank < topo.size and skip_reason:  # the case cannot run here: every check is a skip
                emit_check = self.check_emitter(item, mesh)
                for check in item.checks:
                    emit_check(check, Status.SKIP, message=skip_reason)
            elif self.rank < topo.size:  # replica 0 runs the case; other replicas wait
                try:
                    if self.plan.bench:
                        run_bench_item(self, item, topo, mesh)
                    else:
                        self.run_item(item, topo, mesh)
                except Exception as exc:  # the op's own exceptions are caught in its steps: this one is ours
                    self._emit_harness_error(item, mesh, exc)
            pieces, self.pieces = self.pieces, {}
            # (a known failure's checks keep the artefact budget for real ones)
            if any(p["failed"] and not (item.xfail and item.xfail.covers(c)) for c, p in pieces.items()):
                self.store.set(f"failed/{item.id}", "1")  # the other ranks save their pieces too
            first = min(
                (c for c, p in pieces.items() if p["failed"] and step_order(c) is not None),
                key=step_order,
                default=None,
            )
            if first is not None:  # a model's step: the ranks agree on its first divergence (after the barrier)
                self.store.set(f"first/{item.id}/{self.rank}", first)
            try:
                missing = self.barrier(item, started + self.plan.timeout)
            except dist.DistNetworkError:
                # The store's host, rank 0, has exited: it found a peer stuck (or died), and the driver is ending
                # the launch.  Exit as it did, not with a traceback a quick exit would make look like a death.
                self.events.file.flush()
                os._exit(EXIT_PEER_STUCK)
            if self.dump_stacks_to is not None:
                faulthandler.cancel_dump_traceback_later()
            if not missing:
                self.current = None
            if missing:
                self.events.stuck(item.id, missing, round(time.time() - started, 1))
                self.events.file.flush()
                if on_stuck:
                    on_stuck(item)
                # The missing peer is still inside its collective: the driver takes every rank's stack (and ends
                # the launch) now, before this rank's exit closes the peer's connections and moves it on.
                time.sleep(self.linger_on_stuck)
                os._exit(EXIT_PEER_STUCK)  # a peer is blocked or dead: the driver ends the launch
            if pieces and self.store.check([f"failed/{item.id}"]):
                self.save_pieces(item, self._first_divergence(item, pieces))
            self.events.done(item.id, time.time() - started, self._new_shim_calls())
            if on_item_done:
                on_item_done(item)

    def _new_shim_calls(self) -> dict[str, int]:
        """The calls each CPU shim handled since the last item (the run's notes say whether a shim was used)."""
        now = shims.calls()
        seen = getattr(self, "_shim_calls_seen", {})
        self._shim_calls_seen = now
        return {name: n - seen.get(name, 0) for name, n in now.items() if n > seen.get(name, 0)}

    def _first_divergence(self, item: Item, pieces: dict[str, dict]) -> dict[str, dict]:
        """The pieces to keep of a failing model step: its first divergence on any rank, not every module after it
        (other checks' pieces as they are)."""
        keys = [f"first/{item.id}/{r}" for r in range(self.world)]
        firsts = [self.store.get(k).decode() for k in keys if self.store.check([k])]
        if not firsts:
            return pieces
        first = min(firsts, key=step_order)
        return {c: p for c, p in pieces.items() if step_order(c) is None or c == first}

    def save_pieces(self, item: Item, pieces: dict[str, dict]) -> None:
        """This rank's pieces of a failing item, for the driver to reassemble (harness/rank/artefacts.py)."""
        path = self.events_dir / PIECES / f"item{item.id}" / f"rank{self.rank}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        pieces = {c: {**p, "got": p["got"].cpu(), "expected": p["expected"].cpu()} for c, p in pieces.items()}
        torch.save(pieces, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)  # the driver never reads a half-written file
        self.failures_saved += 1

    def barrier(self, item: Item, deadline: float) -> list[int]:
        """Store-based check-in (does not touch the process groups a stuck peer may hold).  Once some rank raised in
        the item, the others wait at most RAISED_GRACE more: a peer still missing then is blocked in a collective
        the raiser left (the item is an error either way), and waiting out the whole --timeout finds nothing more."""
        self.store.set(f"{item.id}/{self.rank}", "1")
        keys = [f"{item.id}/{r}" for r in range(self.world)]
        raised = f"raised/{item.id}"
        while True:
            now = time.time()
            if raised and self.store.check([raised]):
                deadline = min(deadline, now + min(RAISED_GRACE, self.plan.timeout))
                raised = ""  # the grace counts from when this rank first saw it
            try:
                self.store.wait(keys, timedelta(seconds=max(min(deadline - now, BARRIER_SLICE), 0.01)))
                return []
            except dist.DistNetworkError:  # the store is gone: for the caller
                raise
            except Exception:  # DistStoreError on timeout
                if time.time() >= deadline:
                    return [r for r, k in enumerate(keys) if not self.store.check([k])]

    def run_item(self, item: Item, topo: Topology, mesh) -> None:
        with contextlib.ExitStack() as contexts:  # what the case's run keeps open (RankContext.contexts)
            self._run_item(item, topo, mesh, contexts)

    def _run_item(self, item: Item, topo: Topology, mesh, contexts: contextlib.ExitStack) -> None:
        """One item on this rank, step by step: golden, call, backward, judge.  A step that ends the item has
        reported why (an error row, a bad-input verdict) and returns None."""
        call = self._golden_step(item, topo, mesh, contexts)
        if call is None:
            return
        outs = self._call_step(call)
        if outs is None:
            return
        # A run that kept its train context open (RankContext.keep_open) gets its backward first, as a training
        # loop runs it, and the context closed before the harness computes anything of its own (a precision
        # run of the reference inside a CP context would meet the context's attention).
        backward_error = self._backward_step(call, outs) if call.ctx.kept_open else None
        if backward_error is not None and not call.case.grad_inputs:  # the kept context failed to close
            self._emit_error(call.emit_check, self._item_checks(item), backward_error, Phase.BACKWARD)
            return
        self.events.phase(item.id, Phase.JUDGING)
        self._judge_outputs(call, outs)
        if call.case.grad_inputs:
            if not call.ctx.kept_open:
                backward_error = self._backward_step(call, outs)
            if not self._judge_gradients(call, backward_error):
                return
        self.emit_comm(call.case, call.ctx, call.counter, call.emit_check)
        self._emit_properties(call.case, call.ctx, call.golden, call.local, outs, call.emit_check)
        self._emit_used_signatures(call)

    def _emit_used_signatures(self, call: _Call) -> None:
        """property:signature of the functions the case called from the families it uses (Case.uses) where one is
        someone else's module: called by keyword, a drift still runs, so it is a row of its own.  An op the run
        selects has its own signature row already (harness/driver/run.py): not repeated here."""
        looked_up, drift = used_drift(call.ctx.modules, self.ops_with_signature_rows)
        if looked_up:
            call.emit_check(
                SIGNATURE_CHECK,
                Status.FAIL if drift else Status.PASS,
                message="; ".join(drift),
                symptom=Symptom.SIGNATURE if drift else None,
            )

    def _golden_step(self, item: Item, topo: Topology, mesh, contexts: contextlib.ExitStack) -> _Call | None:
        """The golden outputs and gradients, the rank's context and its pieces of the inputs."""
        case = self.cases[(item.op, item.case_id)]
        self.budget_scope = case.budget_scope
        n_summands = 1
        for d in case.summed_over:
            n_summands *= mesh_dims(mesh).sizes[d]
        emit_check = self.check_emitter(item, mesh)
        self._enter(item, Phase.FORWARD)
        try:
            golden = self.golden(case, item, n_summands)
        except Exception as exc:
            for check in self._item_checks(item):
                emit_check(
                    check,
                    Status.ERROR,
                    message=f"reference failed: {type(exc).__name__}: {exc}",
                    symptom=Symptom.REFERENCE,
                    **_error_fields(exc),
                    phase=Phase.SETUP,
                )
            return None
        impl = self.impls[case.family]
        ctx = RankContext(
            mesh=mesh,
            topology=topo,
            device=self.device,
            dtype=DTYPES[item.dtype],
            full_shapes={k: tuple(v.shape) for k, v in golden.inputs.items()},
            input_layouts=case.input_layouts,
            impl=impl,
            full_inputs=golden.inputs,
            contexts=contexts,
            params=case.params,
            modules={fam: used_by_one_case(self.impls[fam]) for fam in case.uses},
        )
        counter = CommCounter(group_dims(mesh) if case.comm else {}, enabled=case.comm is not None)
        call = _Call(
            item, case, impl, mesh, ctx, golden, self._local_inputs(case, golden, mesh), counter, emit_check, contexts
        )
        index = {name: i for i, name in enumerate(case.output_names)}
        ctx.judge_output = lambda name, got, lay: self._judge_arriving(call, index.get(name), got, lay)
        return call

    def _call_step(self, call: _Call) -> tuple | None:
        """The op under test on this rank's pieces: its outputs, or None when that already decided the item (it
        raised, answered bad input silently, is a properties-only case, or returned the wrong number of outputs)."""
        case, emit_check = call.case, call.emit_check
        try:
            outs = self._call_op(case, call.impl, call.ctx, call.local, call.counter)
        except Exception as exc:
            if case.bad_input is not None:  # loud: any exception will do
                status, message = case.bad_input.judge_raise(exc)
                emit_check(
                    BAD_INPUT_CHECK,
                    status,
                    message=message,
                    keep_message=True,
                    symptom=None if status == Status.PASS else Symptom.PROPERTY,
                )
            else:
                self._emit_error(emit_check, self._item_checks(call.item), exc, Phase.FORWARD)
            return None
        if case.bad_input is not None and case.bad_input.interpretation is None:
            emit_check(BAD_INPUT_CHECK, Status.FAIL, message=case.bad_input.silent_return(), symptom=Symptom.PROPERTY)
            return None
        # Bad input with a documented interpretation that the op answered: judged as any case from here on.
        if not case.output_names:  # a properties-only case: they get the raw result
            self._emit_properties(case, call.ctx, call.golden, call.local, (outs,), emit_check)
            return None
        outs = as_tuple(outs)
        if len(outs) != len(case.output_names):
            for check in self._item_checks(call.item):
                emit_check(
                    check,
                    Status.ERROR,
                    message=f"op returned {len(outs)} outputs, expected {len(case.output_names)}",
                    symptom=Symptom.OUTPUTS,
                    phase=Phase.FORWARD,
                )
            return None
        return outs

    def _judge_outputs(self, call: _Call, outs: tuple) -> None:
        """Every output against this rank's piece of the golden (or the case's own output check)."""
        case, golden, mesh, emit_check = call.case, call.golden, call.mesh, call.emit_check
        for i, (name, check, got, gold, naive, lay) in enumerate(
            zip(case.output_names, case.forward_checks, outs, golden.outputs, golden.naive_outputs, case.output_layouts)
        ):
            if call.arrival_error is not None and call.arrival_error[0] == i:  # the harness raised judging it
                raise call.arrival_error[1]
            if i in call.verdicts:  # judged as it arrived: its precision step and row now, in output order
                self._emit_verdict(
                    emit_check,
                    call.verdicts.pop(i),
                    mesh,
                    golden.inputs,
                    precision=(golden, lambda run, i=i: run[0][i], call.ctx.dtype),
                )
                continue
            if gold is None:  # the reference returns None here (e.g. an optional output): so must the op
                emit_check(
                    check,
                    Status.PASS if got is None else Status.FAIL,
                    message="" if got is None else f"expected None, got {type(got).__name__}",
                    symptom=None if got is None else Symptom.OUTPUT_TYPE,
                )
                continue
            expected = lay.local(gold, mesh, golden.inputs)
            if name in case.output_checks:
                try:
                    ok, msg = case.output_checks[name](got, expected, golden.inputs, call.local, call.ctx)
                except Exception as exc:
                    ok, msg = False, f"{type(exc).__name__}: {exc}"
                emit_check(
                    check, Status.PASS if ok else Status.FAIL, message=msg, symptom=None if ok else Symptom.VALUES
                )
                continue
            got_dtype = got.dtype if isinstance(got, torch.Tensor) else None
            if isinstance(got, torch.Tensor):
                got = lay.reduce_partial(got, mesh)
            self._emit_compare(
                emit_check,
                check,
                got,
                expected,
                gold,
                naive,
                lay,
                mesh,
                golden.inputs,
                expect_dtype=naive.dtype,
                got_dtype=got_dtype,
                precision=(golden, lambda run, i=i: run[0][i], call.ctx.dtype),
            )

    def _judge_gradients(self, call: _Call, backward_error: Exception | None) -> bool:
        """Every checked input's gradient against its piece of the golden; False when the backward raised."""
        case, golden, mesh, emit_check = call.case, call.golden, call.mesh, call.emit_check
        grad_checks = [f"grad:{n}" for n in case.grad_inputs]
        if backward_error is not None:
            if case.bad_input is not None:  # loud, if late: its forward rows stand as they are
                status, message = case.bad_input.judge_raise(backward_error)
                emit_check(
                    BAD_INPUT_CHECK,
                    status,
                    message=f"in backward: {message}",
                    keep_message=True,
                    symptom=None if status == Status.PASS else Symptom.PROPERTY,
                )
            else:
                self._emit_error(emit_check, grad_checks, backward_error, Phase.BACKWARD)
            return False
        self.events.phase(call.item.id, Phase.JUDGING)
        for name, check in zip(case.grad_inputs, grad_checks):
            x = call.local[name]
            if x.grad is None:
                emit_check(
                    check, Status.FAIL, message=f"no gradient reached input {name!r}", symptom=Symptom.NO_GRADIENT
                )
                continue
            lay = case.input_layouts.get(name, REPLICATED)
            expected = lay.local(golden.grads[name], mesh, golden.inputs)
            self._emit_compare(
                emit_check,
                check,
                x.grad,
                expected,
                golden.grads[name],
                golden.naive_grads[name],
                lay,
                mesh,
                golden.inputs,
                expect_dtype=x.dtype,
                precision=(golden, lambda run, name=name: run[1][name], call.ctx.dtype),
            )
        return True

    def _local_inputs(self, case: Case, golden: Golden, mesh) -> dict[str, torch.Tensor]:
        """This rank's pieces of the full inputs, on its device, requiring grad where the case checks it."""
        local = {}
        for name, full in golden.inputs.items():
            piece = case.input_layouts.get(name, REPLICATED).local(full, mesh, golden.inputs).clone().to(self.device)
            local[name] = piece.requires_grad_(name in case.grad_inputs)
        return local

    @staticmethod
    def _call_op(case: Case, impl, ctx: RankContext, local: dict, counter: CommCounter):
        """The case's run of the op under test (its forward), its collectives counted."""
        with counter:
            return case.run(impl, ctx, local)

    def _backward_step(self, call: _Call, outs: tuple) -> Exception | None:
        """Backpropagate the golden upstream gradients (this rank's summand) from the outputs, then close
        what the run kept open; the exception, if any (reported on the gradient checks)."""
        item, case, golden, mesh, counter, contexts = (
            call.item,
            call.case,
            call.golden,
            call.mesh,
            call.counter,
            call.contexts,
        )
        self._enter(item, Phase.BACKWARD)
        pairs = []
        summand = self._summand_index(case, mesh)
        for got, up, lay in zip(outs, golden.upstream, case.output_layouts):
            if up is not None:
                pairs.append((got, lay.local(up[summand], mesh, golden.inputs).to(got.dtype).to(self.device)))
        try:
            counter.phase = Phase.BACKWARD
            if pairs:
                with counter:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            contexts.close()  # a step's train context ends after its backward, as in a training loop
        except Exception as exc:
            return exc
        return None

    def _item_checks(self, item: Item) -> list[str]:
        """The checks this rank reports on when it cannot judge them one by one (the op raised, the harness did): the
        plan's, or every check of a model case whose step has named them on this rank (its plan has the loss alone,
        StepCase)."""
        case = self.cases.get((item.op, item.case_id))
        if isinstance(case, StepCase) and case.model is not None and case.model.named():
            return case.forward_checks
        return item.checks

    def _enter(self, item: Item, phase: Phase) -> None:
        self._phase = phase  # (for a harness error's row: where this rank was)
        self.events.phase(item.id, phase)

    def check_emitter(self, item: Item, mesh):
        """emit_check(check, status, **fields) for this rank and item."""
        coords = mesh_coords(mesh)
        case = self.cases.get((item.op, item.case_id))
        third_party = case is not None and not is_ours(self.plan.impl.get(case.family))

        def emit_check(check: str, status: str, prop=None, **fields):
            if case is not None:  # where the check's rule comes from (Case.rule_of), and what a rule of ours weighs
                status, fields = under_rule(case.rule_of(check, prop), status, fields, third_party)
            self.events.checked(item.id, check=check, status=status, coords=coords, **fields)
            self._emitted.add(check)
            if status == Status.ERROR and not fields.get("secondary"):
                self.store.set(f"raised/{item.id}", "1")  # the peers at the barrier stop waiting sooner (barrier)

        return emit_check

    @staticmethod
    def emit_comm(case: Case, ctx: RankContext, counter: CommCounter, emit_check) -> None:
        """property:comm: the collectives seen against the case's contract."""
        if case.comm is None:
            return
        try:
            allowed = case.comm(ctx)
            observed = counter.as_dict(allowed)
            too_much = comm_violations(observed, allowed)
        except Exception as exc:
            allowed, observed, too_much = None, counter.as_dict(), [f"contract failed: {type(exc).__name__}: {exc}"]
        calls, nbytes = split_comm(observed)
        # Beyond the contract is a performance finding (warn); a contract that cannot be evaluated fails.
        status = Status.FAIL if allowed is None else Status.WARN if too_much else Status.PASS
        emit_check(
            "property:comm",
            status,
            message="; ".join(too_much),
            symptom=None if status == Status.PASS else Symptom.COMM,
            comm_calls=calls,
            comm_bytes=nbytes,
            comm_allowed=allowed,
        )

    def _emit_properties(self, case: Case, ctx, golden: Golden, local, outs: tuple, emit_check) -> None:
        if case.properties is None:
            return
        try:
            props = case.properties(ctx, golden.inputs, local, outs)
        except Exception as exc:
            self._emit_error(emit_check, ["property:properties"], exc, "properties")
            return
        for p in props:
            emit_check(
                f"property:{p.name}",
                Status.PASS if p.passed else Status.FAIL,
                prop=p,
                message=p.message,
                symptom=None if p.passed else Symptom.PROPERTY,
                max_abs_err=p.value,
                max_rel_err=None,
                budget=None,
                err_ratio=None,
            )

    @staticmethod
    def _summand_index(case: Case, mesh) -> int:
        index = 0
        for d in case.summed_over:
            index = index * mesh_dims(mesh).sizes[d] + mesh_dims(mesh).coords[d]
        return index

    def _judge_arriving(self, call: _Call, index: int | None, got: torch.Tensor, lay) -> bool:
        """RankContext.judge_output: output `index` of the run judged the moment the run makes it (a model case's
        hook), its verdict kept for `_judge_outputs` and the tensor left to the run to drop.  False: judge it after
        the run as usual (an output the golden has none of, or with a check of the case's own)."""
        case, golden, mesh = call.case, call.golden, call.mesh
        if call.arrival_error is not None:  # the harness failed on an earlier one: reported after the run
            return True
        if index is None or golden.outputs[index] is None or case.output_names[index] in case.output_checks:
            return False
        try:
            gold, naive = golden.outputs[index], golden.naive_outputs[index]
            expected = lay.local(gold, mesh, golden.inputs)
            got_dtype = got.dtype
            got = lay.reduce_partial(got, mesh)
            call.verdicts[index] = self._measure(
                case.forward_checks[index],
                got,
                expected,
                gold,
                naive,
                lay,
                mesh,
                golden.inputs,
                naive.dtype,
                got_dtype,
                arriving=True,
            )
        except Exception as exc:  # raised as the harness's own error once the run is over, not as the model's
            call.arrival_error = (index, exc)
        return True

    def _emit_compare(
        self,
        emit_check,
        check,
        got,
        expected,
        gold_full,
        naive_full,
        lay,
        mesh,
        inputs,
        expect_dtype,
        got_dtype=None,
        precision=None,
    ):
        """Judge one local tensor against its slice of the golden with per-element budgets.  `precision`
        = (golden, pick(run) -> this tensor of a Golden.precision_run, item dtype): a failing check that
        a legitimate precision difference explains becomes `warn`."""
        if not isinstance(got, torch.Tensor):
            emit_check(
                check, Status.FAIL, message=f"got {type(got).__name__}, expected a tensor", symptom=Symptom.OUTPUT_TYPE
            )
            return
        verdict = self._measure(check, got, expected, gold_full, naive_full, lay, mesh, inputs, expect_dtype, got_dtype)
        self._emit_verdict(emit_check, verdict, mesh, inputs, precision)

    def _measure(
        self,
        check,
        got,
        expected,
        gold_full,
        naive_full,
        lay,
        mesh,
        inputs,
        expect_dtype,
        got_dtype=None,
        arriving: bool = False,
    ) -> _Verdict:
        """One local tensor's verdict before the precision step.  `arriving`: judged as the run made it (a model
        case's step), so only a summary is kept, plus the tensors of this rank's first failing check of the step
        (its failure artefact) and, with per-row budgets, those of a failing check (the precision step's)."""
        stats, status, ratio, limit = _judge(
            got, expected, gold_full, naive_full, expect_dtype, lay, mesh, inputs, self.budget_scope
        )
        msg = ""
        symptom = (
            None
            if status == Status.PASS
            else (
                Symptom.SHAPE
                if "shape_mismatch" in stats
                else Symptom.NONFINITE
                if stats.get("nonfinite")
                else Symptom.VALUES
            )
        )
        got_dtype = got_dtype or got.dtype
        if got_dtype != expect_dtype:
            status, msg, symptom = (
                Status.FAIL,
                f"dtype {str(got_dtype)[6:]}, expected {str(expect_dtype)[6:]}",
                Symptom.DTYPE,
            )
        for key in ("worst", "nonfinite"):
            if stats.get(key):
                stats[key]["global_index"] = list(
                    lay.global_index(stats[key]["local_index"], gold_full.shape, mesh, inputs)
                )
        piece = None
        if (
            self.failures_saved < self.plan.failure_artefacts
            and "shape_mismatch" not in stats
            and gold_full.numel() <= MAX_ARTEFACT_NUMEL
            and (not arriving or self._first_failing(check, status))
        ):
            piece = {
                "got": got.detach() if not arriving else got.detach().clone(),
                "expected": expected.detach(),
                "indices": lay.mesh_indices(gold_full.shape, mesh, inputs),
                "budget": limit,
                "full_shape": tuple(gold_full.shape),
                "failed": status == Status.FAIL,
                "coords": mesh_coords(mesh),
            }
            if arriving:  # the step's first failing check on this rank replaces a later one's
                self.pieces = {c: p for c, p in self.pieces.items() if step_order(c) is None}
            self.pieces[check] = piece
        # A tensor-wide budget is one number: the precision step then needs the largest error alone, not the tensors.
        elementwise = not arriving or (status == Status.FAIL and self.budget_scope != BudgetScope.TENSOR)
        return _Verdict(
            check,
            stats,
            status,
            ratio,
            msg,
            symptom,
            got_dtype,
            expect_dtype,
            gold_full,
            lay,
            got if elementwise else None,
            expected if elementwise else None,
            piece,
        )

    def _first_failing(self, check: str, status: Status) -> bool:
        """Whether a failing model check comes before every model check whose piece this rank keeps."""
        order = step_order(check)
        if status != Status.FAIL or order is None:
            return False
        kept = [step_order(c) for c in self.pieces if step_order(c) is not None]
        return all(order < k for k in kept)

    def _emit_verdict(self, emit_check, v: _Verdict, mesh, inputs, precision=None) -> None:
        """The precision step of a verdict (a failing check that a legitimate precision difference explains becomes
        `warn`), then its row."""
        stats, status, msg, symptom = v.stats, v.status, v.message, v.symptom
        if (
            status == Status.FAIL
            and precision is not None
            and "shape_mismatch" not in stats
            and not stats.get("nonfinite")
        ):
            finding, kind = self._precision_finding(v, mesh, inputs, *precision, scope=self.budget_scope)
            allowed = precision[0].case.allows_float32 if kind == "float32" else None
            if finding and allowed:  # the family's documented precision: not a finding at all
                status, msg, symptom = Status.PASS, f"{finding}, which the contract allows ({allowed})", None
            elif finding:
                status, msg, symptom = (
                    Status.WARN,
                    "; ".join(m for m in (finding, msg) if m),
                    Symptom(f"precision:{kind}"),
                )
        if v.piece is not None:
            v.piece["failed"] = status == Status.FAIL
        stats.pop("err_ratio", None)
        emit_check(
            v.check,
            status,
            err_ratio=v.ratio if v.ratio != float("inf") else None,
            message=msg,
            symptom=symptom,
            keep_message=status == Status.PASS and bool(msg),  # a precision the contract allows, cited
            **{"budget": None, "err_naive": None, **stats},
        )

    @staticmethod
    def _precision_finding(
        v: _Verdict, mesh, inputs, golden, pick, item_dtype, scope=BudgetScope.ROW
    ) -> tuple[str, str]:
        """(words, "float32" | "bfloat16") of the precision difference that explains a failing check, or ("", ""):
        a float64 item within the float32 budget of the same item, a bfloat16 item within the budget of bfloat16
        math."""
        kind, low = {torch.float64: ("float32", torch.float32), torch.bfloat16: ("bfloat16 math", torch.bfloat16)}.get(
            item_dtype, (None, None)
        )
        if kind is None or v.got_dtype not in (v.expect_dtype, low):
            return "", ""
        try:  # a tensor-wide budget (one value): the largest error against it is the largest ratio, as compare()'s
            alt = pick(golden.precision_run(kind) if v.got is not None else golden.precision_limits(kind, low))
        except Exception:  # the reference cannot run that way: no excuse for the error
            return "", ""
        if v.got is not None:
            _, status, ratio, _ = _judge(v.got, v.expected, v.gold_full, alt, low, v.lay, mesh, inputs, scope)
        else:
            status, ratio = _judge_largest(v.stats["max_abs_err"], alt)
        if status != Status.PASS:
            return "", ""
        if kind == "float32":
            return f"float64 computed in float32 (err/budget {ratio:.2g} against the float32 budget)", "float32"
        return (
            f"bfloat16 math, docs/ops/README.md asks for float32 (err/budget {ratio:.2g} against bfloat16 math)",
            "bfloat16",
        )

    def _emit_harness_error(self, item: Item, mesh, exc: Exception) -> None:
        """An exception of shardcheck's own code on this rank (slicing a layout, the golden, judging, artefacts): an
        error on each check of `item` this rank has not reported yet, naming the exception and the harness line that
        raised it, so the rank goes on to the next item instead of dying."""
        frames = traceback.extract_tb(exc.__traceback__)
        where = _relative(frames[-1].filename, frames[-1].lineno) if frames else "?:0"
        first = str(exc).splitlines()[0][:200] if str(exc) else ""
        phase = self._phase
        emit_check = self.check_emitter(item, mesh)
        # A collective of the harness's own (summing a Partial output) failing because a peer failed is a consequence.
        secondary = is_peer_failure(exc)
        checks = self._item_checks(item)
        for check in [c for c in checks if c not in self._emitted] or checks:
            emit_check(
                check,
                Status.ERROR,
                secondary=secondary,
                symptom=Symptom.BLOCKED if secondary else Symptom.HARNESS,
                phase=phase,
                error_type=type(exc).__name__,
                error_message=first,
                error_where=where,
                message=f"shardcheck's own code raised {type(exc).__name__}: {first} ({where}, in {phase}); "
                "a harness defect, not the op's",
            )

    def _emit_error(self, emit_check, checks, exc: BaseException, phase: str) -> None:
        """An exception the op (or a property) raised in `phase`: an error on each of `checks`."""
        fields = _error_fields(exc)
        msg = f"{fields['error_type']}: {fields['error_message']} ({Path(fields['error_where']).name})"
        # A collective failing because a peer died or left is a consequence, not the cause.
        secondary = is_peer_failure(exc)
        for check in checks:
            emit_check(
                check, Status.ERROR, message=msg, secondary=secondary, symptom=Symptom.EXCEPTION, phase=phase, **fields
            )


# Frames of the harness, the suites, the references, torch and the standard library: not the code under test.
_NOT_UNDER_TEST = tuple(
    str(p) + os.sep
    for p in (
        *(
            Path(package.__file__).resolve().parent
            for package in (shardcheck.harness, shardcheck.suites, shardcheck.reference, torch)
        ),
        Path(sysconfig.get_paths()["stdlib"]).resolve(),
    )
)


def raising_location(exc: BaseException) -> str:
    """path:line where `exc` was raised: the innermost frame of the code under test (the module under test or
    what it calls, not torch nor the harness), else the innermost frame.  Paths inside the working directory are
    relative to it."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?:0"
    under_test = [f for f in frames if not str(Path(f.filename).resolve()).startswith(_NOT_UNDER_TEST)]
    frame = (under_test or frames)[-1]
    return _relative(frame.filename, frame.lineno)


def _relative(filename: str, lineno: int | None) -> str:
    """path:line, the path relative to the working directory where it is inside it."""
    path = Path(filename).resolve()
    root = Path.cwd()  # where the user ran shardcheck: `tests/broken/x.py:12`, not a long absolute path
    return f"{path.relative_to(root) if path.is_relative_to(root) else path}:{lineno}"


def _error_fields(exc: BaseException) -> dict:
    return {
        "error_type": type(exc).__name__,
        "error_message": str(exc).splitlines()[0][:200] if str(exc) else "",
        "error_where": raising_location(exc),
    }


def _judge(
    got, expected, gold_full, ref_full, dtype, lay, mesh, inputs, scope: BudgetScope = BudgetScope.ROW
) -> tuple[dict, str, float, torch.Tensor]:
    """(stats, status, err/budget, this rank's budgets) of a local tensor against its slice of the golden,
    with the budgets of a reference `ref_full` run in `dtype` (shardcheck.harness.core.compare.budget)."""
    b_full, naive_err_full = budget(gold_full, ref_full, dtype, scope)
    limit = lay.local(b_full, mesh, inputs)
    err_naive = lay.local(naive_err_full, mesh, inputs) if naive_err_full is not None else None
    stats = compare(got, expected, limit, err_naive)
    status, ratio = judge(stats)
    return stats, status, ratio, limit


def _judge_largest(max_abs_err: float, limit: float) -> tuple[str, float]:
    """(status, err/budget) of a tensor whose budget is one value throughout (BudgetScope.TENSOR), from its largest
    error alone: what compare() and judge() give on the tensor itself (an error where the budget is 0: inf)."""
    ratio = 0.0 if max_abs_err == 0 else (max_abs_err / limit if limit > 0 else math.inf)
    return (Status.PASS if ratio <= 1.0 else Status.FAIL), ratio


def _rendezvous(launch_dir: Path, rank: int, world: int, timeout: float) -> dist.Store:
    """The launch's store: rank 0 hosts it on a port the system picks and writes the port to
    LAUNCH_DIR/store-port (written whole, then renamed); the others wait for that file and connect."""
    port_file = launch_dir / "store-port"
    wait = timedelta(seconds=timeout + 120)
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=wait, wait_for_workers=False)
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(str(store.port))
        os.replace(tmp, port_file)
        return store
    deadline = time.time() + wait.total_seconds()
    while not port_file.exists():
        if time.time() > deadline:
            raise TimeoutError(f"rank 0 wrote no {port_file}")
        time.sleep(0.01)
    return dist.TCPStore("127.0.0.1", int(port_file.read_text()), world, is_master=False, timeout=wait)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only whether the process exists
    except (ProcessLookupError, PermissionError):  # (PermissionError: another user's process took the pid)
        return False
    return True


def _wait_for(path: Path, seconds: float, driver: int) -> bool:
    """Whether `path` appeared within `seconds` while the driver (pid `driver`) lived: a rank orphaned by a driver
    killed outright does not wait out the rest.  (The driver, not the parent: a forked rank's parent is the fork
    server, which lives as long as any process it forked.)"""
    start = time.time()
    while not path.exists():
        waited = time.time() - start
        if waited > seconds or not _alive(driver):
            return False
        # 10 ms while a plan is due (the driver writes the next at once), 50 ms for a launch kept idle in a pool
        time.sleep(0.01 if waited < 1.0 else 0.05)
    return True


def serve(launch_dir: Path, plan_wait: float, device: str, backend: str, timeout: float, use_shims: bool) -> int:
    """The driver's rank: rendezvous, then run LAUNCH_DIR/plan0.json, plan1.json, ... as they come; exit when a plan
    file says STOP or none comes within `plan_wait` seconds."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    driver = int(os.environ.get("SHARDCHECK_DRIVER_PID", os.getppid()))
    # (forked ranks all show the fork server's command line: this names the process of each rank)
    (launch_dir / f"rank{rank}.pid").write_text(str(os.getpid()))
    # Every thread's Python stack on SIGUSR1, written by faulthandler's C handler: it runs while this rank is
    # blocked in C++ (a gloo wait) or spinning in Python; the driver asks before it ends a hung launch.
    stacks = open(stack_path(launch_dir, rank), "a")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True, chain=False)
    store = _rendezvous(launch_dir, rank, world, timeout)
    worker = Worker(device, backend, timeout, use_shims, store=store, rank=rank, world=world)
    worker.recorder = flight_recorder.install(launch_dir, rank) if flight_recorder.enabled() else None
    worker.linger_on_stuck = STUCK_LINGER
    profile = None
    for k in itertools.count():
        path = launch_dir / f"plan{k}.json"
        if not _wait_for(path, plan_wait, driver):
            break
        text = path.read_text()
        if text == STOP:
            break
        plan = Plan.from_json(text)
        if (
            plan.profile and profile is None
        ):  # `shardcheck run --profile`: this rank's cProfile, read by reports/profile.py
            profile = cProfile.Profile()
            profile.enable()
        worker.load(plan, launch_dir / f"plan{k}")
        worker.run()
        if profile is not None:
            profile.disable()
            out = Path(plan.profile) / f"w{world}-rank{rank}-{os.getpid()}.prof"
            out.parent.mkdir(parents=True, exist_ok=True)
            profile.dump_stats(out)
            profile.enable()
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardcheck.harness.rank.worker")
    parser.add_argument(
        "--launch-dir", type=Path, help="the launch's folder: plans come, events go there (driver mode)"
    )
    parser.add_argument("--plan-wait", type=float, default=900.0, help="seconds to wait for each plan")
    parser.add_argument("--launch-device", default="cpu")
    parser.add_argument("--launch-backend", default="gloo")
    parser.add_argument("--launch-timeout", type=float, default=60.0, help="the run's --timeout")
    parser.add_argument("--launch-no-shims", action="store_true")
    parser.epilog = (
        "started by the driver; a torchrun written by hand runs `-m shardcheck.harness.standalone`, "
        "which plans, runs this worker on every rank and collects"
    )
    args = parser.parse_args(argv)
    if not args.launch_dir:
        parser.error("--launch-dir is required (a torchrun written by hand runs -m shardcheck.harness.standalone)")
    return serve(
        args.launch_dir,
        args.plan_wait,
        args.launch_device,
        args.launch_backend,
        args.launch_timeout,
        not args.launch_no_shims,
    )


if __name__ == "__main__":
    sys.exit(main())
