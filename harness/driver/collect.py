"""Turn the per-rank event files of one launch into result rows, item by item.

Besides the rows, the collector writes what a failing item leaves for debugging: a `rerun`
command that runs that item alone (on every fail/error row), and, for the first failures of
a run, the full expected and actual tensors reassembled from every rank's piece, with an
error map (harness/rank/artefacts.py, reports/error_map.py)."""

from __future__ import annotations

import re
import shlex
import shutil
import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

from shardcheck.harness.core.compare import merge_ranks
from shardcheck.harness.core.events import PIECES, Checked, Done, Event, PhaseEntered, Started, Stuck
from shardcheck.harness.core.modules import is_ours, is_path
from shardcheck.harness.core.options import DEFAULT_TIMEOUT
from shardcheck.harness.core.plan_data import MODEL_CONFIG_SUITE, Item, Plan, Xfail
from shardcheck.harness.core.records import NO_CAUSE, RecordWriter, ResultRow, Status, Symptom
from shardcheck.harness.core.topology import Topology, named_coords
from shardcheck.harness.driver.item_cause import Ending, Root, abort_notes, cause_words, choose_root
from shardcheck.harness.rank.artefacts import ArtefactBudget

if TYPE_CHECKING:
    from shardcheck.harness.driver.postmortem import Postmortem


class _ItemState:
    def __init__(self):
        self.started: dict[int, float] = {}
        self.done: dict[int, float] = {}  # rank -> seconds the item took there
        self.phase: dict[int, str] = {}
        self.checks: dict[str, list[dict]] = defaultdict(list)
        self.stuck: list[Stuck] = []


class Collector:
    """Follows DIR/rank*.jsonl of one launch; writes a row per check when an item is complete."""

    def __init__(
        self,
        plan: Plan,
        items: list[Item],
        events_dir: Path,
        writer: RecordWriter,
        world_size: int,
        artefacts: ArtefactBudget | None = None,
    ):
        self.plan, self.events_dir, self.writer, self.world = plan, events_dir, writer, world_size
        self.items = {i.id: i for i in items}
        self.state = {i.id: _ItemState() for i in items}
        self.finished: set[int] = set()
        # Kept as events arrive, so that a poll costs what is new, not what the launch has run so far.
        self._started_unfinished: set[int] = set()
        self._complete: list[int] = []  # items every rank reported done, not yet finished
        self._offsets: dict[Path, int] = {}
        self.last_event = 0.0
        self.artefacts = artefacts

    def poll(self) -> list[Item]:
        """Read new events; return the items finished by them."""
        for path in sorted(self.events_dir.glob("rank*.jsonl")):
            with open(path) as fh:
                fh.seek(self._offsets.get(path, 0))
                data = fh.read()
            end = data.rfind("\n") + 1  # only whole lines; the rest is still being written
            self._offsets[path] = self._offsets.get(path, 0) + len(data[:end].encode())
            for line in data[:end].splitlines():
                if line.strip():
                    self._event(Event.from_json(line))
        newly = []
        for item_id in sorted(self._complete):
            if item_id not in self.finished:
                self._finish(self.items[item_id])
                newly.append(self.items[item_id])
        self._complete = []
        return newly

    def _event(self, ev: Event) -> None:
        st = self.state.get(ev.item)
        if st is None:
            return
        self.last_event = max(self.last_event, ev.time)
        match ev:
            case Started():
                st.started[ev.rank] = ev.time
                if ev.item not in self.finished:
                    self._started_unfinished.add(ev.item)
            case PhaseEntered():
                st.phase[ev.rank] = ev.phase
            case Checked():
                st.checks[ev.check].append(ev.as_rank_result())
            case Stuck():
                st.stuck.append(ev)
            case Done():
                st.done[ev.rank] = ev.seconds
                self.writer.count_shim_calls(ev.shim_calls or {})
                if len(st.done) == self.world:
                    self._complete.append(ev.item)

    def in_flight(self) -> Item | None:
        """The earliest unfinished item that some rank has started."""
        return self.items[min(self._started_unfinished)] if self._started_unfinished else None

    def unfinished(self) -> list[Item]:
        return [self.items[i] for i in sorted(self.state.keys() - self.finished)]

    def all_finished(self) -> bool:
        return len(self.finished) == len(self.state)

    def _mark_finished(self, item: Item) -> None:
        self.finished.add(item.id)
        self._started_unfinished.discard(item.id)

    def abort(
        self, item: Item, reason: str, deaths: dict[int, str] | None = None, evidence: Postmortem | None = None
    ) -> str:
        """Finish `item` as an error: ranks that did not report a check are named, with what they were doing.
        `deaths` maps the ranks whose process died by itself (not in the teardown) to how ('SIGKILL',
        'exit code 13'): each check of the case names them, and the other ranks' rows say they waited on them.
        The item has one cause (harness/driver/item_cause.py), recorded on each of its error rows.  `evidence`
        (harness/driver/postmortem.py): the ranks' stacks and collectives, and the dead ranks' last words, taken
        before the launch ended; its words join the finding, and the ranks it names (a collective they never entered
        or mismatched, a loop they ran while the others waited) are a hang's culprits.  Returns the cause in a few
        words ('hung', 'rank 1 died'), for the items skipped after it."""
        st = self.state[item.id]
        participants = _participants(item)
        deaths = {r: how for r, how in (deaths or {}).items() if r in participants}
        end = Ending(
            participants,
            deaths,
            evidence.last_words if evidence else {},
            sorted({r for ev in st.stuck for r in ev.missing} - set(deaths)),
            self._first_exception(item),
            st.phase,
            evidence,
        )
        root = choose_root(end, st.done)
        notes = abort_notes(end, root, self.plan.timeout, reason)
        named = evidence is not None and bool(evidence.culprits) and root.symptom == Symptom.HUNG
        for check in item.checks or ["forward"]:
            _fill_missing(st, check, end, root, notes, named)
        self._finish(item, extra_message="; ".join(notes), root=root)
        return cause_words(end, root, reason)

    def _first_exception(self, item: Item) -> dict | None:
        """The first rank result of `item` (in check order, then by rank) that raised on its own (not after a
        peer failed), with `culprit_ranks`: every rank that raised the same on its own; or None."""
        st = self.state[item.id]
        own = [
            ev
            for check in [*item.checks, *(c for c in st.checks if c not in item.checks)]
            for ev in sorted(st.checks.get(check, []), key=lambda e: e["rank"])
            if ev["status"] == Status.ERROR and not ev.get("secondary") and ev.get("error_type")
        ]
        if not own:
            return None
        first = own[0]
        same = {
            ev["rank"]
            for ev in own
            if (ev["error_type"], ev.get("error_where")) == (first["error_type"], first.get("error_where"))
        }
        return {**first, "culprit_ranks": sorted(same)}

    def skip(self, item: Item, reason: str) -> None:
        """Record every check of `item` as skipped, without running it."""
        for check in item.checks or ["forward"]:
            self.writer.write(
                self._row(
                    item,
                    check,
                    {
                        "status": Status.SKIP,
                        "max_abs_err": None,
                        "max_rel_err": None,
                        "budget": None,
                        "err_ratio": None,
                        "err_naive": None,
                        "mismatch": None,
                        "message": reason,
                        "per_rank": [],
                        **NO_CAUSE,
                    },
                )
            )
        self._mark_finished(item)

    def _finish(self, item: Item, extra_message: str = "", root: Root | None = None) -> None:
        """Merge every check's rank results into its row and write the rows.  `root`: the cause of an aborted
        item, recorded on each of its error rows; otherwise the item's first exception is the cause of the
        error rows that have none of their own (no result from ranks that stopped after it)."""
        st = self.state[item.id]
        aborted = root is not None
        if not aborted:
            raised = self._first_exception(item)
            root = None if raised is None else Root.raised(raised, [])
        rows = {
            check: _merged_row(item, per_rank, extra_message, root, aborted) for check, per_rank in st.checks.items()
        }
        if item.xfail is not None:  # before the artefacts: a known failure spends none of the budget
            rows = known_failure(rows, item.xfail)
        self._save_artefacts(item, rows)
        # an aborted item: from its start to its end by the driver (what a hang cost)
        seconds = (
            round(max(st.done.values()), 4)
            if st.done and not aborted
            else round(time.time() - min(st.started.values()), 4)
            if aborted and st.started
            else None
        )
        for check, merged in rows.items():
            self.writer.write({**self._row(item, check, merged), "item_seconds": seconds})
        self._mark_finished(item)

    def _save_artefacts(self, item: Item, rows: dict[str, dict]) -> None:
        """The failing checks' tensors (the artefact budget's), their paths on the rows; the item's pieces removed."""
        pieces = self.events_dir / PIECES / f"item{item.id}"
        failing = [c for c, m in rows.items() if m["status"] == Status.FAIL]
        if pieces.is_dir():
            if failing and self.artefacts is not None:
                saved = self.artefacts.save(item, failing, pieces, self.writer.path.parent)
                for check, paths in saved.items():
                    rows[check].update(paths)
            shutil.rmtree(pieces, ignore_errors=True)

    def _row(self, item: Item, check: str, merged: dict) -> ResultRow:
        dp, cp, tp = item.topology
        family = item.op.split(".", 1)[0]
        row: ResultRow = {
            "run_id": self.plan.run_id,
            "op": item.op,
            "family": family,
            "impl": self.plan.impl.get(family),
            "suite": item.suite,
            "case_id": item.case_id,
            "params": item.params,
            "dp": dp,
            "cp": cp,
            "tp": tp,
            "ep": item.ep,
            "dp_replicate": item.dp_replicate,
            "world_size": item.world_size,
            "dtype": item.dtype,
            "device": self.plan.device,
            "backend": self.plan.backend,
            "seed": item.seed,
            "check": check,
            **merged,
        }
        uses = self.plan.uses.get(item.op)
        if uses:  # the other families' modules the case called (Case.uses): `impl` stays its own family's
            row["uses_impl"] = {fam: self.plan.impl.get(fam) for fam in uses}
        if merged["status"] not in (
            Status.PASS,
            Status.SKIP,
        ):  # findings, and known failures (the report lists their reruns)
            row["rerun"] = rerun_command(self.plan, item)
        return row


def known_failure(rows: dict[str, dict], mark: Xfail) -> dict[str, dict]:
    """An item's merged rows ({check: row}) with its KnownFailure applied to the checks it covers.  While a
    covered check fails or errors on some rank (a hang or a death included) those are `xfail`, the finding kept
    in the message, and the covered checks that pass stay `pass` (the defect is still there, the mark still
    needed); once every covered check that ran passes on every rank they are `xpass`: the mark must go.
    A wrong value is the defect whatever budget its error happens to fit: a `warn` for precision (an error within
    the bfloat16-math budget, say) counts as failing too.  Skips and other warnings (collectives beyond the
    contract) stay as they are.  Covered rows carry the mark's reason and reference as fields."""
    covered = {check for check in rows if mark.covers(check)}
    fields = {"xfail_reason": mark.reason, "xfail_reference": mark.reference}

    def failing(row: dict) -> bool:
        return row["status"] in (Status.FAIL, Status.ERROR) or (
            row["status"] == Status.WARN and str(row.get("symptom") or "").startswith("precision:")
        )

    still_failing = any(failing(rows[c]) for c in covered)
    out = dict(rows)
    for check in covered:
        row = rows[check]
        if failing(row):
            out[check] = {
                **row,
                **fields,
                "status": Status.XFAIL,
                "message": "; ".join(m for m in (row["message"], mark.words()) if m),
            }
        elif row["status"] == Status.PASS and not still_failing:
            now = (
                f"passes on every rank, but is marked as a {mark.words()}: the defect looks fixed, "
                "remove the KnownFailure mark (or narrow its checks or `when`)"
            )
            out[check] = {
                **row,
                **fields,
                "status": Status.XPASS,
                "symptom": Symptom.XPASS,
                "message": "; ".join(m for m in (now, row["message"]) if m),
            }
    return out


def glob_escape(text: str) -> str:
    """`text` as an fnmatch pattern that matches exactly `text` (`[`, `*`, `?` bracketed)."""
    return re.sub(r"([\[*?])", r"[\1]", text)


def rerun_command(plan: Plan, item: Item) -> str:
    """A `shardcheck run` command line that runs exactly `item` (same inputs: the run's seed, from which
    the item's seed is derived) and nothing else."""
    dp, cp, tp = item.topology
    family = item.op.split(".", 1)[0]
    external = [arg for path in plan.suite_paths if Path(path).stem == item.suite for arg in ("--suite-path", path)]
    families = [family, *plan.uses.get(item.op, [])]
    if plan.model_config and item.suite == MODEL_CONFIG_SUITE:  # its suite (and module) written again from DIR
        external, families = ["--model-config", plan.model_config], families[1:]
    args = [
        "shardcheck",
        "run",
        *external,
        "--suite",
        item.suite,
        "--op",
        item.op,
        "--case",
        glob_escape(item.case_id),
        "--topology",
        f"dp={dp},cp={cp},tp={tp}"
        + (f",ep={item.ep}" if item.ep != 1 else "")
        + (f",dp_replicate={item.dp_replicate}" if item.dp_replicate != 1 else ""),
        "--dtype",
        item.dtype,
        "--seed",
        str(plan.seed),
        "--device",
        plan.device,
    ]
    # The other families a model case calls (Case.uses) too, each by its own --impl.
    args += _impl_args(plan, families)
    if item.fuzz is not None and plan.corpus:  # a fuzz case: the corpus rebuilds it from the params saved there
        args += ["--corpus", plan.corpus]
    if plan.quick:
        args.append("--quick")
    if plan.bench:
        args += ["--bench", "--bench-iters", str(plan.bench_iters)]
    if plan.timeout != DEFAULT_TIMEOUT:
        args += ["--timeout", f"{plan.timeout:g}"]
    return shlex.join(args)


def signature_rerun(plan: Plan, op: str, suite: str) -> str:
    """A `shardcheck run` command line that checks `op`'s signature in the module under test again (and runs its
    cases on one rank, where the module defines it)."""
    family = op.split(".", 1)[0]
    external = [arg for path in plan.suite_paths if Path(path).stem == suite for arg in ("--suite-path", path)]
    args = ["shardcheck", "run", *external, "--suite", suite, "--op", op, "--topology", "dp=1,cp=1,tp=1"]
    return shlex.join(args + ["--dtype", "float64", "--quick", *_impl_args(plan, [family])])


def _impl_args(plan: Plan, families: list[str]) -> list[str]:
    """`--impl FAMILY=MODULE` of each of `families` whose module under test is not our seed module (the default
    IMPLEMENTATION of an external suite's family too): a rerun then needs nothing else of the run to test the same
    module."""
    args = []
    for fam in families:
        spec = plan.impl.get(fam)
        if spec and not is_ours(spec, fam):
            if is_path(spec):
                spec = str(Path(spec).resolve())  # the command works from any directory
            args += ["--impl", f"{fam}={spec}"]
    return args


def _participants(item: Item) -> list[int]:
    """Ranks that run `item` (replica 0 of its topology)."""
    dp, cp, tp = item.topology
    return list(range(dp * cp * tp))


def _coords_of(rank: int, topology: Topology) -> dict:
    """A rank's coordinates as its own rows name them (harness/rank/item_run.py: ep/edp and HSDP's parts too)."""
    _, cp, tp = topology.dp, topology.cp, topology.tp
    return named_coords({"dp": rank // (cp * tp), "cp": (rank // tp) % cp, "tp": rank % tp}, topology)


def _merged_row(item: Item, per_rank: list[dict], extra_message: str, root: Root | None, aborted: bool) -> dict:
    """One check's row from its rank results; an error row takes `root` as its cause where the item was aborted,
    or where ranks stopped after the culprit (no result from them here)."""
    for r in per_rank:
        r.setdefault("coords", None)
        if r["coords"] is None:
            r["coords"] = _coords_of(r["rank"], item.full_topology)
    merged = merge_ranks(per_rank, _participants(item))
    if extra_message and merged["status"] != Status.PASS and extra_message not in merged["message"]:
        merged["message"] = "; ".join(m for m in (merged["message"], extra_message) if m)
    if (
        root
        and merged["status"] == Status.ERROR
        and (aborted or merged["symptom"] in (Symptom.MISSING, Symptom.BLOCKED))
    ):
        # the ranks that stopped after the culprit: the aborted item's, or those without a result here
        blocked = (
            root.blocked_ranks
            if aborted
            else [r for r in merged["blocked_ranks"] + merged["culprit_ranks"] if r not in root.culprit_ranks]
        )
        merged.update({**root.fields(), "blocked_ranks": sorted(set(blocked))})
    return merged


def _fill_missing(st: _ItemState, check: str, end: Ending, root: Root, notes: list[str], named: bool) -> None:
    """`check`'s rank results of an aborted item completed: a dead rank's is its death, whatever it reported; a
    rank that reported nothing gets an error saying where it was (a consequence, unless the item hung or it is the
    rank that raised; `named`: the stacks named a hang's culprits); a blocked peer of a dead rank says it waited."""
    per_rank = st.checks[check]
    reported = {ev["rank"]: ev for ev in per_rank}
    # A rank that reported a wrong result here comes before one that reported nothing: the blocked rank's own error
    # ("connection closed by peer", a consequence) may or may not reach its events before the launch is ended, and
    # the row must not name a different rank depending on which.
    reported_bad = any(ev["status"] in (Status.FAIL, Status.ERROR) and not ev.get("secondary") for ev in per_rank)
    deaths, words = end.deaths, end.last_words
    waiting_on = ", ".join(f"rank {r} (died: {how})" for r, how in sorted(deaths.items()))
    for r in end.participants:
        phase = end.phase_of(r)
        if r in deaths:  # whatever it reported, the case did not complete there
            per_rank[:] = [ev for ev in per_rank if ev["rank"] != r]
            said = f": {words[r]}" if words.get(r) else ""
            died = _rank_error(r, check, f"died: {deaths[r]} (in {phase}){said}", Symptom.DIED, phase, error=deaths[r])
            per_rank.append(died)
        elif r not in reported:
            where = f"still in {phase}" if r in st.started else "never started the case"
            first = f"waiting on {waiting_on}; no result ({where})" if deaths else f"no result ({where})"
            after_peer = (root.symptom != Symptom.HUNG or named) and r not in root.culprit_ranks
            symptom = Symptom.BLOCKED if after_peer else root.symptom
            message = "; ".join([first, *notes])
            per_rank.append(_rank_error(r, check, message, symptom, phase, secondary=after_peer or reported_bad))
        elif deaths and reported[r]["status"] == Status.ERROR and reported[r].get("secondary"):
            reported[r]["message"] = f"waiting on {waiting_on}: {reported[r]['message']}"


def _rank_error(
    rank: int, check: str, message: str, symptom: str, phase: str, *, secondary: bool = False, error: str | None = None
) -> dict:
    """A rank result the driver writes for a rank of an aborted item (`error`: how a dead rank died)."""
    result = {
        "rank": rank,
        "coords": None,
        "check": check,
        "status": Status.ERROR,
        "secondary": secondary,
        "message": message,
        "symptom": symptom,
    }
    return {**result, **({"error_type": error} if error is not None else {}), "phase": phase}
