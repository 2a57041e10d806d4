"""A run's rows made to say what its findings lines say: the rows of a line demoted to `warn` (an exception only on
input our rule feeds, under --impl: shardcheck.harness.findings.causes, module docstring 5) become `warn` rows.

The demotion is decided per line, after the rows are grouped by root, so it cannot be made by the ranks row by row;
once decided, the rows follow, so that everything that reads statuses agrees with the lines: the exit code (it counts
rows), the JUnit (an item whose worst row is a `warn` is a passing testcase with the warning in its output), the
report's counts and the regression compare.  Each such row keeps what it was, `demoted_from: "error"`, and its
message says why; causes.py reads it as the error it was and decides again, the same way."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from shardcheck.harness.core.records import RESULTS, RUN_META, Status, load, write_json
from shardcheck.harness.findings.causes import causes, causes_and_demoted, demoted_lines
from shardcheck.harness.findings.known import known_failures

DEMOTED_NOTE = "raised only on input our rule feeds, which the seed leaves open: a warn under --impl (loud or right)"


@dataclass(frozen=True)
class Findings:
    """A run's findings, computed once for everyone who shows them (the report, the CLI, the CI summary)."""

    causes: pd.DataFrame  # one row per cause (causes.COLUMNS)
    known: pd.DataFrame  # one row per known failure (causes.KNOWN_COLUMNS)


def findings(df: pd.DataFrame) -> Findings:
    """The findings of rows read from disk (a run settled earlier: `shardcheck report`)."""
    return Findings(causes(df), known_failures(df))


@dataclass(frozen=True)
class SettledRun:
    """A run once its rows say what its findings say: what every output of the run (reports/sinks.py) is made from."""

    run_dir: Path
    rows: pd.DataFrame  # results.jsonl as settled
    findings: Findings
    counts: dict[str, int]  # rows per status, after the demotions
    meta: dict  # run.json


def demote(df: pd.DataFrame) -> pd.DataFrame:
    """`df` with the rows of each demoted line made `warn` (`demoted_from` "error", the rule in the message)."""
    return _demote(df, demoted_lines(df))


def _demote(df: pd.DataFrame, lines: list[tuple[list, str]]) -> pd.DataFrame:
    if not lines:
        return df
    df = df.copy()
    if "demoted_from" not in df:
        df["demoted_from"] = None
    for members, rule in lines:
        errors = [i for i in members if df.at[i, "status"] == Status.ERROR]
        for i in errors:
            df.at[i, "message"] = _noted(df.at[i, "message"], rule)
        df.loc[errors, "demoted_from"] = Status.ERROR.value
        df.loc[errors, "status"] = Status.WARN.value
    return df


def _noted(message, rule: str) -> str:
    return "; ".join(m for m in (str(message or ""), f"{DEMOTED_NOTE} [{rule}]") if m)


def settle(run_dir: Path, counts: dict[str, int]) -> SettledRun:
    """The run read once: its rows grouped into findings once, the rows of demoted lines made `warn` (`demote`),
    results.jsonl and run.json's summary rewritten where that moved any row; `counts` (rows per status) after it."""
    run_dir = Path(run_dir)
    meta_path = run_dir / RUN_META
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    df = load(run_dir)  # one file: its index is the order of its non-blank lines
    table, lines = causes_and_demoted(df)
    changed = _demote(df, lines)
    moved = [i for i in changed.index if changed.at[i, "status"] != df.at[i, "status"]] if changed is not df else []
    if moved:
        counts = _rewrite(run_dir, changed, moved, counts)
        meta = {**meta, "summary": {str(k): v for k, v in counts.items()}}
        if meta_path.is_file():
            write_json(meta_path, meta)
    return SettledRun(run_dir, changed, Findings(table, known_failures(changed)), counts, meta)


def _rewrite(run_dir: Path, changed: pd.DataFrame, moved: list, counts: dict[str, int]) -> dict[str, int]:
    """results.jsonl with the `moved` rows demoted (each line otherwise as the ranks wrote it); the new counts."""
    path = run_dir / RESULTS
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    for i in moved:
        row = json.loads(lines[i])
        row.update(status=Status.WARN.value, demoted_from=Status.ERROR.value, message=changed.at[i, "message"])
        lines[i] = json.dumps(row)
    path.write_text("\n".join(lines) + "\n")
    return {
        **counts,
        Status.ERROR: counts.get(Status.ERROR, 0) - len(moved),
        Status.WARN: counts.get(Status.WARN, 0) + len(moved),
    }


def read_settled(run_dir: Path) -> SettledRun:
    """A run settled earlier, as it lies on disk (`shardcheck report` rebuilds its pages from it)."""
    meta_path = run_dir / RUN_META
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    df = load(run_dir)
    counts = {str(k): int(v) for k, v in df["status"].value_counts().items()} if "status" in df else {}
    return SettledRun(run_dir, df, findings(df), counts, meta)
