"""One item on one rank, step by step: golden, call, backward, judge; each check's row emitted as an event.

The rank process around it (rendezvous, the plan loop, the barrier after each item) is harness/rank/worker.py; the
judging of one tensor is harness/rank/judge.py (tensors in, verdicts out); emitting the verdicts is this module's.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from shardcheck.harness.core.bad_input import BAD_INPUT_CHECK
from shardcheck.harness.core.case import Case, PrecisionOnly, as_tuple
from shardcheck.harness.core.grad_convention import GradConvention
from shardcheck.harness.core.layout import REPLICATED, Layout
from shardcheck.harness.core.measure import CommCounter, comm_violations, group_dims, split_comm
from shardcheck.harness.core.model_case import StepCase, step_order
from shardcheck.harness.core.modules import is_ours
from shardcheck.harness.core.plan_data import DTYPES, Item
from shardcheck.harness.core.rank_context import RankContext
from shardcheck.harness.core.records import SIGNATURE_CHECK, Phase, Status, Symptom
from shardcheck.harness.core.rules import under_rule
from shardcheck.harness.core.topology import Topology, mesh_coords, mesh_dims, named_coords
from shardcheck.harness.rank.artefacts import MAX_NUMEL as MAX_ARTEFACT_NUMEL
from shardcheck.harness.rank.errors import error_fields, harness_error_row, op_error_row
from shardcheck.harness.rank.golden import Golden
from shardcheck.harness.rank.judge import Budget, Comparison, Placement, PrecisionRun, Verdict, measure, settle
from shardcheck.harness.rank.loaded_plan import LoadedPlan
from shardcheck.harness.rank.signatures import used_by_one_case, used_drift


@dataclass
class Call:
    """The op's run on this rank: what the steps after the golden hand each other."""

    case: Case
    impl: object  # the module under test
    ctx: RankContext
    golden: Golden
    local: dict[str, torch.Tensor]  # this rank's pieces of the inputs
    counter: CommCounter
    contexts: contextlib.ExitStack
    # Outputs judged as the run made them (RankContext.judge_output): {output index: verdict}, settled and emitted in
    # output order after the run; the first exception the harness raised judging one, with its output's index
    # (raised when the judging after the run reaches that output, as it would have raised judging it there).
    verdicts: dict[int, Verdict] = field(default_factory=dict)
    arrival_error: tuple[int, Exception] | None = None


@dataclass(frozen=True)
class Output:
    """One output of the op beside what it is judged against."""

    index: int
    name: str
    check: str
    got: object
    gold: torch.Tensor | None  # the float64 golden's (None: the op must return None too)
    naive: torch.Tensor | None  # the reference's in the item's dtype
    layout: Layout


@dataclass
class ItemRun:
    """One item on this rank: its steps, the checks it reported, the tensors it keeps for failure artefacts."""

    loaded: LoadedPlan
    item: Item
    topo: Topology
    mesh: object
    phase: Phase = Phase.SETUP  # where this rank is (for a harness error's row)
    emitted: set[str] = field(default_factory=set)  # the checks this rank reported for the item
    pieces: dict[str, dict] = field(default_factory=dict)  # compared tensors kept for failure artefacts
    model_failed: bool = False  # a model case's check failed on this rank: the checks after it are its consequences
    case: Case | None = field(init=False)
    coords: dict = field(init=False)  # this rank's place in the mesh, on every row
    third_party: bool = field(init=False)  # the module under test is someone else's (core/rules.py)

    def __post_init__(self) -> None:
        self.case = self.loaded.cases.get((self.item.op, self.item.case_id))
        self.coords = named_coords(mesh_coords(self.mesh), self.item.full_topology)  # with ep/edp, HSDP's parts
        self.third_party = self.case is not None and not is_ours(self.loaded.plan.impl.get(self.case.family))

    # ---- rows

    def emit(self, check: str, status: str, prop=None, **fields) -> None:
        """One check's row for this rank, under the check's rule (Case.rule_of; what a rule of ours weighs)."""
        if self.case is not None:
            status, fields = under_rule(self.case.rule_of(check, prop, self.topo), status, fields, self.third_party)
        self.loaded.events.checked(self.item.id, check=check, status=status, coords=self.coords, **fields)
        self.emitted.add(check)
        if status == Status.ERROR and not fields.get("secondary"):
            self.loaded.store.set(f"raised/{self.item.id}", "1")  # the peers at the barrier stop waiting sooner

    def skip(self, reason: str) -> None:
        """The case cannot run here: every check is a skip."""
        for check in self.item.checks:
            self.emit(check, Status.SKIP, message=reason)

    def emit_error(self, checks: list[str], exc: BaseException, phase: str) -> None:
        """An exception the op (or a property) raised in `phase`: an error on each of `checks`."""
        fields = op_error_row(exc, phase)
        for check in checks:
            self.emit(check, Status.ERROR, **fields)

    def emit_harness_error(self, exc: Exception) -> None:
        """An exception of shardcheck's own code on this rank: an error on each check of the item this rank has not
        reported yet, so the rank goes on to the next item instead of dying."""
        fields = harness_error_row(exc, self.phase)
        checks = self.item_checks()
        for check in [c for c in checks if c not in self.emitted] or checks:
            self.emit(check, Status.ERROR, **fields)

    def item_checks(self) -> list[str]:
        """The checks this rank reports on when it cannot judge them one by one (the op raised, the harness did): the
        plan's, or every check of a model case whose step has named them on this rank (its plan has the loss alone,
        StepCase)."""
        case = self.case
        if isinstance(case, StepCase) and case.model is not None and case.model.named():
            return case.forward_checks
        return self.item.checks

    def emit_comm(self, ctx: RankContext, counter: CommCounter) -> None:
        """property:comm: the collectives seen against the case's contract."""
        case = self.case
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
        self.emit(
            "property:comm",
            status,
            message="; ".join(too_much),
            symptom=None if status == Status.PASS else Symptom.COMM,
            comm_calls=calls,
            comm_bytes=nbytes,
            comm_allowed=allowed,
        )

    def _emit_properties(self, call: Call, outs: tuple) -> None:
        case = call.case
        if case.properties is None:
            return
        try:
            props = case.properties(call.ctx, call.golden.inputs, call.local, outs)
        except Exception as exc:
            self.emit_error(["property:properties"], exc, "properties")
            return
        for p in props:
            self.emit(
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

    def _emit_used_signatures(self, call: Call) -> None:
        """property:signature of the functions the case called from the families it uses (Case.uses) where one is
        someone else's module: called by keyword, a drift still runs, so it is a row of its own.  An op the run
        selects has its own signature row already (harness/driver/run.py): not repeated here."""
        looked_up, drift = used_drift(call.ctx.modules, self.loaded.ops_with_signature_rows)
        if looked_up:
            self.emit(
                SIGNATURE_CHECK,
                Status.FAIL if drift else Status.PASS,
                message="; ".join(drift),
                symptom=Symptom.SIGNATURE if drift else None,
            )

    def _emit_bad_input_raise(self, exc: Exception, when: str = "") -> None:
        """A bad-input case's op raised: loud, which is what it should be (any exception will do)."""
        status, message = self.case.bad_input.judge_raise(exc)
        self.emit(
            BAD_INPUT_CHECK,
            status,
            message=f"{when}{message}",
            keep_message=True,
            symptom=None if status == Status.PASS else Symptom.PROPERTY,
        )

    # ---- steps

    def run(self) -> None:
        """Every step of the item.  A step that ends the item has reported why (an error row, a bad-input verdict)."""
        with contextlib.ExitStack() as contexts:  # what the case's run keeps open (RankContext.contexts)
            self._steps(contexts)

    def _steps(self, contexts: contextlib.ExitStack) -> None:
        call = self._golden_step(contexts)
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
            self.emit_error(self.item_checks(), backward_error, Phase.BACKWARD)
            return
        self.loaded.events.phase(self.item.id, Phase.JUDGING)
        for output in _outputs(call, outs):
            self._judge_output(call, output)
        if call.case.grad_inputs:
            if not call.ctx.kept_open:
                backward_error = self._backward_step(call, outs)
            if not self._judge_gradients(call, backward_error):
                return
        self.emit_comm(call.ctx, call.counter)
        self._emit_properties(call, outs)
        self._emit_used_signatures(call)

    def _enter(self, phase: Phase) -> None:
        self.phase = phase
        self.loaded.events.phase(self.item.id, phase)

    def _golden_step(self, contexts: contextlib.ExitStack) -> Call | None:
        """The golden outputs and gradients, the rank's context and its pieces of the inputs."""
        case, mesh = self.case, self.mesh
        n_summands = 1
        for d in case.summed_over:
            n_summands *= mesh_dims(mesh).sizes[d]
        self._enter(Phase.FORWARD)
        try:
            golden = self.loaded.goldens.get(case, self.item, n_summands)
        except Exception as exc:
            for check in self.item_checks():
                self.emit(
                    check,
                    Status.ERROR,
                    message=f"reference failed: {type(exc).__name__}: {exc}",
                    symptom=Symptom.REFERENCE,
                    **error_fields(exc),
                    phase=Phase.SETUP,
                )
            return None
        impls = self.loaded.impls
        ctx = RankContext(
            mesh=mesh,
            topology=self.topo,
            device=self.loaded.device,
            dtype=DTYPES[self.item.dtype],
            full_shapes={k: tuple(v.shape) for k, v in golden.inputs.items()},
            input_layouts=case.input_layouts,
            impl=impls[case.family],
            full_inputs=golden.inputs,
            contexts=contexts,
            params=case.params,
            modules={fam: used_by_one_case(impls[fam]) for fam in case.uses},
        )
        counter = CommCounter(group_dims(mesh) if case.comm else {}, enabled=case.comm is not None)
        local = self._local_inputs(golden)
        call = Call(case, impls[case.family], ctx, golden, local, counter, contexts)
        index = {name: i for i, name in enumerate(case.output_names)}
        ctx.judge_output = lambda name, got, lay: self.judge_arriving(call, index.get(name), got, lay)
        return call

    def _local_inputs(self, golden: Golden) -> dict[str, torch.Tensor]:
        """This rank's pieces of the full inputs, on its device, requiring grad where the case checks it."""
        case, local = self.case, {}
        for name, full in golden.inputs.items():
            piece = case.input_layouts.get(name, REPLICATED).local(full, self.mesh, golden.inputs)
            local[name] = piece.clone().to(self.loaded.device).requires_grad_(name in case.grad_inputs)
        return local

    def _call_step(self, call: Call) -> tuple | None:
        """The op under test on this rank's pieces: its outputs, or None when that already decided the item (it
        raised, answered bad input silently, is a properties-only case, or returned the wrong number of outputs)."""
        case = call.case
        try:
            outs = _call_op(call)
        except Exception as exc:
            if case.bad_input is not None:
                self._emit_bad_input_raise(exc)
            else:
                self.emit_error(self.item_checks(), exc, Phase.FORWARD)
            return None
        if case.bad_input is not None and case.bad_input.interpretation is None:
            self.emit(BAD_INPUT_CHECK, Status.FAIL, message=case.bad_input.silent_return(), symptom=Symptom.PROPERTY)
            return None
        # Bad input with a documented interpretation that the op answered: judged as any case from here on.
        if not case.output_names:  # a properties-only case: they get the raw result
            self._emit_properties(call, (outs,))
            return None
        outs = as_tuple(outs)
        if len(outs) != len(case.output_names):
            for check in self.item_checks():
                self.emit(
                    check,
                    Status.ERROR,
                    message=f"op returned {len(outs)} outputs, expected {len(case.output_names)}",
                    symptom=Symptom.OUTPUTS,
                    phase=Phase.FORWARD,
                )
            return None
        return outs

    def _backward_step(self, call: Call, outs: tuple) -> Exception | None:
        """Backpropagate the golden upstream gradients (this rank's summand) from the outputs, then close
        what the run kept open; the exception, if any (reported on the gradient checks)."""
        case, golden, mesh = call.case, call.golden, self.mesh
        self._enter(Phase.BACKWARD)
        pairs = []
        summand = _summand_index(case, mesh)
        for got, up, lay in zip(outs, golden.upstream, case.output_layouts):
            if up is not None:
                pairs.append((got, lay.local(up[summand], mesh, golden.inputs).to(got.dtype).to(self.loaded.device)))
        try:
            call.counter.phase = Phase.BACKWARD
            if pairs:
                with call.counter:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            call.contexts.close()  # a step's train context ends after its backward, as in a training loop
        except Exception as exc:
            return exc
        return None

    # ---- judging

    def _judge_output(self, call: Call, out: Output) -> None:
        """One output against this rank's piece of the golden (or the case's own output check)."""
        case, golden = call.case, call.golden
        precision = PrecisionRun(golden, lambda run, i=out.index: run[0][i], call.ctx.dtype)
        if call.arrival_error is not None and call.arrival_error[0] == out.index:  # the harness raised judging it
            raise call.arrival_error[1]
        if out.index in call.verdicts:  # judged as it arrived: its precision step and row now, in output order
            self._emit_verdict(call.verdicts.pop(out.index), precision)
            return
        if out.gold is None:  # the reference returns None here (e.g. an optional output): so must the op
            ok = out.got is None
            message = "" if ok else f"expected None, got {type(out.got).__name__}"
            self.emit(
                out.check,
                Status.PASS if ok else Status.FAIL,
                message=message,
                symptom=None if ok else Symptom.OUTPUT_TYPE,
            )
            return
        expected = out.layout.local(out.gold, self.mesh, golden.inputs)
        if out.name in case.output_checks:
            try:
                result = case.output_checks[out.name](out.got, expected, golden.inputs, call.local, call.ctx)
            except Exception as exc:
                result = False, f"{type(exc).__name__}: {exc}"
            if isinstance(result, PrecisionOnly):  # right values in a lower dtype: our precision rule's warning
                self.emit(out.check, Status.WARN, message=result.message, symptom=result.symptom)
                return
            ok, msg = result
            self.emit(
                out.check, Status.PASS if ok else Status.FAIL, message=msg, symptom=None if ok else Symptom.VALUES
            )
            return
        got = out.got
        if not isinstance(got, torch.Tensor):
            self._emit_not_a_tensor(out.check, got)
            return
        got_dtype = got.dtype
        got = out.layout.reduce_partial(got, self.mesh)
        scale = golden.output_scale(out.index)
        budget = Budget(
            out.gold,
            out.naive,
            out.naive.dtype,
            case.budget_scope,
            scale,
            case.compute_dtype,
            golden.budgets,
            golden.input_scale(gradient=False),
        )
        place = Placement(out.layout, self.mesh, golden.inputs)
        self._emit_verdict(self._measure(Comparison(out.check, got, expected, budget, place, got_dtype)), precision)

    def _judge_gradients(self, call: Call, backward_error: Exception | None) -> bool:
        """Every checked input's gradient against its piece of the golden; False when the backward raised."""
        case, golden = call.case, call.golden
        grad_checks = [f"grad:{n}" for n in case.grad_inputs]
        if backward_error is not None:
            if case.bad_input is not None:  # loud, if late: its forward rows stand as they are
                self._emit_bad_input_raise(backward_error, "in backward: ")
            else:
                self.emit_error(grad_checks, backward_error, Phase.BACKWARD)
            return False
        self.loaded.events.phase(self.item.id, Phase.JUDGING)
        for name, check in zip(case.grad_inputs, grad_checks):
            x = call.local[name]
            if x.grad is None:
                self.emit(
                    check, Status.FAIL, message=f"no gradient reached input {name!r}", symptom=Symptom.NO_GRADIENT
                )
                continue
            if not isinstance(x.grad, torch.Tensor):
                self._emit_not_a_tensor(check, x.grad)
                continue
            place = Placement(case.input_layouts.get(name, REPLICATED), self.mesh, golden.inputs)
            self._emit_verdict(*self._gradient_verdict(call, name, check, place))
        return True

    def _gradient_verdict(
        self, call: Call, name: str, check: str, place: Placement
    ) -> tuple[Verdict, PrecisionRun | None]:
        """(verdict, its precision run) of input `name`'s gradient under the first of the case's conventions
        (Case.grad_conventions) it matches, before the precision step, else after it; matching none, the first
        convention's, its message naming every one tried.  The row records the convention matched."""
        case, x = call.case, call.local[name]
        several = len(case.grad_conventions) > 1
        tried = []
        for convention in case.grad_conventions:
            golden = call.golden
            if convention == GradConvention.OWN:
                golden = golden.own_summand(_summand_index(case, self.mesh))
            budget = Budget(
                golden.grads[name],
                golden.naive_grads[name],
                x.dtype,
                case.budget_scope,
                golden.grad_scale(),
                kept=golden.budgets,
                input_scale=golden.input_scale(gradient=True),
            )
            comparison = Comparison(check, x.grad, place.local(golden.grads[name]), budget, place, x.grad.dtype)
            verdict = self._measure(comparison) if not tried else measure(comparison)[0]
            precision = PrecisionRun(golden, lambda run: run[1][name], call.ctx.dtype)
            if verdict.status == Status.PASS:
                return _with_convention(verdict, convention if several else None), precision
            tried.append((convention, verdict, precision))
        if not several:
            return tried[0][1], tried[0][2]
        settled = [(c, settle(v, p)) for c, v, p in tried]
        for convention, verdict in settled:
            if verdict.status != Status.FAIL:
                return _with_convention(verdict, convention), None
        words = "; ".join(f"{c.words}: err/budget {v.ratio:.3g}" for c, v in settled)
        first = settled[0][1]
        message = "; ".join(m for m in (first.message, f"matches no accepted gradient convention ({words})") if m)
        return dataclasses.replace(first, message=message), None

    def _emit_not_a_tensor(self, check: str, got: object) -> None:
        message = f"got {type(got).__name__}, expected a tensor"
        self.emit(check, Status.FAIL, message=message, symptom=Symptom.OUTPUT_TYPE)

    def judge_arriving(self, call: Call, index: int | None, got: torch.Tensor, lay: Layout) -> bool:
        """RankContext.judge_output: output `index` of the run judged the moment the run makes it (a model case's
        hook), its verdict kept for the judging after the run and the tensor left to the run to drop.  False: judge
        it after the run as usual (an output the golden has none of, or with a check of the case's own)."""
        case, golden = call.case, call.golden
        if call.arrival_error is not None:  # the harness failed on an earlier one: reported after the run
            return True
        if index is None or golden.outputs[index] is None or case.output_names[index] in case.output_checks:
            return False
        try:
            gold, naive = golden.outputs[index], golden.naive_outputs[index]
            place = Placement(lay, self.mesh, golden.inputs)
            expected = place.local(gold)
            reduced = lay.reduce_partial(got, self.mesh)
            scale = golden.output_scale(index)
            # No budget kept with the golden here (kept=None): judged as they arrive, a model's activations keep one
            # tensor's budget at a time (tests/test_model_case_cost.py), not one per module.
            budget = Budget(
                gold,
                naive,
                naive.dtype,
                case.budget_scope,
                scale,
                case.compute_dtype,
                None,
                golden.input_scale(gradient=False),
            )
            comparison = Comparison(case.forward_checks[index], reduced, expected, budget, place, got.dtype)
            call.verdicts[index] = self._measure(comparison, arriving=True)
        except Exception as exc:  # raised as the harness's own error once the run is over, not as the model's
            call.arrival_error = (index, exc)
        return True

    def _measure(self, c: Comparison, arriving: bool = False) -> Verdict:
        """The verdict of one local tensor before the precision step, its tensors kept for a failure artefact while
        the plan's budget lasts (of a model case's step: only this rank's first failing check)."""
        verdict, limit = measure(c, arriving)
        if (
            self.loaded.failures_saved < self.loaded.plan.failure_artefacts
            and "shape_mismatch" not in verdict.stats
            and c.budget.gold_full.numel() <= MAX_ARTEFACT_NUMEL
            and (not arriving or self._first_failing(c.check, verdict.status))
        ):
            place = c.place
            piece = {
                "got": c.got.detach() if not arriving else c.got.detach().clone(),
                "expected": c.expected.detach(),
                # where the piece sits: its indices are worked out only if the item fails (Worker.save_pieces)
                "place": place,
                "budget": limit,
                "full_shape": tuple(c.budget.gold_full.shape),
                "failed": verdict.status == Status.FAIL,
                "coords": named_coords(mesh_coords(place.mesh), self.item.full_topology),
            }
            if arriving:  # the step's first failing check on this rank replaces a later one's
                self.pieces = {k: p for k, p in self.pieces.items() if step_order(k) is None}
            self.pieces[c.check] = piece
        return verdict

    def _first_failing(self, check: str, status: Status) -> bool:
        """Whether a failing model check comes before every model check whose piece this rank keeps."""
        order = step_order(check)
        if status != Status.FAIL or order is None:
            return False
        kept = [step_order(c) for c in self.pieces if step_order(c) is not None]
        return all(order < k for k in kept)

    def _emit_verdict(self, verdict: Verdict, precision: PrecisionRun) -> None:
        """The precision step of a verdict (judge.settle: it may run the reference again), then its row; its kept
        piece, if any, says whether the check failed after that step.  In a model case's step (checks in step order) a
        check failing after one that failed is its consequence, not a precision difference of its own: no excuse (an
        AdamW step, nearly blind to its gradient's scale, would leave a wrong gradient's parameters within float32's
        budget, a second finding of the same bug)."""
        in_step = step_order(verdict.check) is not None
        verdict = settle(verdict, None if in_step and self.model_failed else precision)
        self.model_failed |= in_step and verdict.status == Status.FAIL
        piece = self.pieces.get(verdict.check)
        if piece is not None:
            piece["failed"] = verdict.status == Status.FAIL
        self.emit(verdict.check, verdict.status, **verdict.row_fields())


def _outputs(call: Call, outs: tuple) -> Iterator[Output]:
    """Each output of the run beside its name, check, golden, reference in the item's dtype and layout."""
    case, golden = call.case, call.golden
    rows = zip(case.output_names, case.forward_checks, outs, golden.outputs, golden.naive_outputs, case.output_layouts)
    for i, (name, check, got, gold, naive, lay) in enumerate(rows):
        yield Output(i, name, check, got, gold, naive, lay)


def _call_op(call: Call):
    """The case's run of the op under test (its forward), its collectives counted."""
    with call.counter:
        return call.case.run(call.impl, call.ctx, call.local)


def _with_convention(verdict: Verdict, convention: GradConvention | None) -> Verdict:
    """`verdict` whose row records the gradient convention it matched (None: the case accepts one only)."""
    if convention is None:
        return verdict
    return dataclasses.replace(verdict, stats={**verdict.stats, "grad_convention": str(convention)})


def _summand_index(case: Case, mesh) -> int:
    index = 0
    for d in case.summed_over:
        index = index * mesh_dims(mesh).sizes[d] + mesh_dims(mesh).coords[d]
    return index
