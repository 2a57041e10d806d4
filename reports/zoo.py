"""The zoo's recall table (`shardcheck zoo`): per field bug, whether the run caught its broken case, at which step,
whether the finding names what the thread's fix touched, whether the fixed twin passes in every dtype, and the time.

Read from the run's records and findings only (shardcheck.harness.findings): the pairs' rows are the rows of the
entry's family, the broken case's finding is the findings line of its op (grouped over both cases' rows, so its
condition is what separates broken from fixed)."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd

from shardcheck.harness.core.records import Status, load
from shardcheck.harness.core.zoo_bug import BROKEN, FIXED, FIXED_DTYPES, Bug
from shardcheck.harness.findings.causes import causes

CAUGHT = {Status.FAIL, Status.ERROR}
FALSE_ALARM = {Status.FAIL, Status.ERROR, Status.WARN, Status.XPASS}
# the targets: of all the zoo's bugs, caught at the first step, named right; no false alarm anywhere
CAUGHT_TARGET, NAMED_TARGET = 0.95, 0.85


@dataclass
class Recall:
    """One bug's line of the table."""

    entry: str
    thread: str
    caught: bool
    step: int | None  # the training step the broken case is caught at (the harness checks one step: 1)
    finding: str  # the first line of the broken case's finding: what it names
    worst: dict[str, str]  # each failing op check of the broken case: its worst line (the rank, the element, values)
    named: bool
    false_alarm: str  # "" or, per dtype, what the fixed twin did that is not a pass
    seconds: float  # the pair's items, summed (their run shares launches: no start-up in it)
    missed: str  # why it counts as missed ("" when caught and named right)
    bug: dict  # the entry's Bug: its thread and URL, the symptom, the time to find, the fix, what it must name


def _item_seconds(rows: pd.DataFrame) -> float:
    if rows.empty or "item_seconds" not in rows:
        return 0.0
    return float(rows.groupby(["case_id", "dtype"])["item_seconds"].max().fillna(0).sum())


def _finding(rows: pd.DataFrame) -> str:
    """The broken case's findings line, as it names its subject: the checks it starts with (a model step's first
    divergence; an op's failing checks), or for an error the error itself (its `worst:` line names the culprit)."""
    table = causes(rows)
    bad = table[table["status"].isin([str(s) for s in CAUGHT])] if len(table) else table
    if bad.empty:
        return ""
    first = bad.iloc[0]
    if first["status"] == str(Status.ERROR):
        return re.sub(r" at \S+:\d+", "", str(first["worst"]).split(" (" + str(first["op"]))[0])
    return str(first["checks"]).split(";")[0]


def _worst(broken: pd.DataFrame) -> dict[str, str]:
    """{check: its worst line} of the broken case's failing op checks (one row per check: merged over the ranks); a
    model step's (`forward:<tensor>`) are left out: its finding names the module or parameter already."""
    bad = broken[
        broken["status"].isin([str(s) for s in CAUGHT]) & ~broken["check"].astype(str).str.startswith("forward:")
    ]
    if bad.empty or "message" not in bad:
        return {}
    return {str(r["check"]): str(r["message"]) for _, r in bad.iterrows()}


def _not_shown(bug: Bug, worst: dict[str, str]) -> str:
    """What of `bug.shows` the worst lines do not show ("" when all of it)."""
    wrong = [
        f"{check} ~ /{pattern}/" for check, pattern in bug.shows.items() if not re.search(pattern, worst.get(check, ""))
    ]
    return "; ".join(wrong)


def _false_alarm(fixed: pd.DataFrame) -> str:
    said = []
    for dtype in FIXED_DTYPES:
        rows = fixed[fixed["dtype"] == dtype]
        bad = sorted(set(rows["status"]) & {str(s) for s in FALSE_ALARM})
        if bad:
            said.append(f"{dtype}: {', '.join(bad)}")
        elif not (rows["status"] == str(Status.PASS)).any():  # absent, or skipped: the twin was not judged there
            said.append(f"{dtype}: not run")
    return "; ".join(said)


def recall_of(name: str, bug: Bug, rows: pd.DataFrame) -> Recall:
    """`bug`'s line from the rows of its run (None: its pair was not run)."""
    if bug.needs is not None:
        return Recall(name, bug.thread, False, None, "", {}, False, "", 0.0, f"needs {bug.needs}", asdict(bug))
    mine = rows[rows["family"] == name] if len(rows) else rows
    broken, fixed = mine[mine["case_id"] == BROKEN], mine[mine["case_id"] == FIXED]
    caught = bool(broken["status"].isin([str(s) for s in CAUGHT]).any())
    finding = _finding(mine) if caught else ""
    worst = _worst(broken) if caught else {}
    named = caught and any(n in finding for n in bug.names)
    missed = "" if named else ("not named: wanted " + " or ".join(bug.names) if caught else "not caught")
    if named and _not_shown(bug, worst):
        named, missed = False, "not shown: wanted " + _not_shown(bug, worst)
    if broken.empty:
        missed = "its broken case did not run"
    return Recall(
        name,
        bug.thread,
        caught,
        1 if caught else None,
        finding,
        worst,
        named,
        _false_alarm(fixed),
        _item_seconds(mine),
        missed,
        asdict(bug),
    )


def recall(run_dir: Path | None, bugs: dict[str, Bug]) -> list[Recall]:
    """The table of `bugs` (entry name -> Bug) from the run in `run_dir` (None: no pair ran)."""
    rows = load(run_dir) if run_dir is not None and (run_dir / "results.jsonl").is_file() else None  # as settled
    if rows is None or rows.empty:
        rows = pd.DataFrame(columns=["family", "case_id", "status", "dtype"])
    return [recall_of(name, bug, rows) for name, bug in bugs.items()]


def summary(lines: list[Recall]) -> dict:
    n = len(lines)
    caught = sum(r.caught and r.step == 1 for r in lines)
    named = sum(r.named for r in lines)
    false_alarms = sum(bool(r.false_alarm) for r in lines)
    return {
        "bugs": n,
        "caught_at_step_1": caught,
        "named_right": named,
        "false_alarms": false_alarms,
        "caught_rate": caught / n if n else 0.0,
        "named_rate": named / n if n else 0.0,
        "targets_met": n > 0 and caught / n >= CAUGHT_TARGET and named / n >= NAMED_TARGET and not false_alarms,
    }


def _cell(text: str, limit: int = 90) -> str:
    text = text.replace("|", "/").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _alarm_cell(r: Recall) -> str:
    return "—" if r.missed.startswith("needs") else (r.false_alarm or "none")


def markdown(lines: list[Recall], command: str) -> str:
    s = summary(lines)
    out = [
        f"`{command}`",
        "",
        "| bug | thread | caught | step | named right | finding (first line) | false alarm (fixed twin) | s "
        "| missed: why |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in lines:
        out.append(
            f"| {r.entry} | {r.thread} | {'yes' if r.caught else 'no'} | {r.step or '—'} | "
            f"{'yes' if r.named else 'no'} | {_cell(r.finding)} | {_alarm_cell(r)} | "
            f"{r.seconds:.1f} | {_cell(r.missed, 120)} |"
        )
    out += [
        "",
        f"**{s['caught_at_step_1']}/{s['bugs']} caught at step 1 ({s['caught_rate']:.0%}, target "
        f"{CAUGHT_TARGET:.0%}), {s['named_right']}/{s['bugs']} named right ({s['named_rate']:.0%}, target "
        f"{NAMED_TARGET:.0%}), {s['false_alarms']} false alarm(s) on the fixed twins (target 0).**",
    ]
    return "\n".join(out) + "\n"


def write(run_dir: Path, lines: list[Recall], command: str) -> tuple[Path, Path]:
    """zoo.md and zoo.json in `run_dir`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    md, js = run_dir / "zoo.md", run_dir / "zoo.json"
    md.write_text(markdown(lines, command))
    js.write_text(json.dumps({"summary": summary(lines), "bugs": [asdict(r) for r in lines]}, indent=1))
    return md, js
