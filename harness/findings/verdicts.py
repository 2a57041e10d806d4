"""A run's rows made to say what its findings lines say: the rows of a line demoted to `warn` (an exception only on
input our rule feeds, under --impl: shardcheck.harness.findings.causes, module docstring 5) become `warn` rows.

The demotion is decided per line, after the rows are grouped by root, so it cannot be made by the ranks row by row;
once decided, the rows follow, so that everything that reads statuses agrees with the lines: the exit code (it counts
rows), the JUnit (an item whose worst row is a `warn` is a passing testcase with the warning in its output), the
report's counts and the regression compare.  Each such row keeps what it was, `demoted_from: "error"`, and its
message says why; causes.py reads it as the error it was and decides again, the same way."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from shardcheck.harness.core.records import RESULTS, RUN_META, Status, write_json
from shardcheck.harness.findings.causes import demoted_lines

DEMOTED_NOTE = "raised only on input our rule feeds, which the seed leaves open: a warn under --impl (loud or right)"


def demote(df: pd.DataFrame) -> pd.DataFrame:
    """`df` with the rows of each demoted line made `warn` (`demoted_from` "error", the rule in the message)."""
    lines = demoted_lines(df)
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


def settle(run_dir: Path, counts: dict[str, int]) -> dict[str, int]:
    """Rewrite the run's results.jsonl with its demoted rows (`demote`) and run.json's summary with the counts;
    returns the counts of each status after it (`counts` where nothing was demoted)."""
    from shardcheck.harness.core.records import load

    path = run_dir / RESULTS
    if not path.is_file():
        return counts
    df = load(run_dir)  # one file: its index is the order of its non-blank lines
    changed = demote(df)
    moved = [i for i in changed.index if changed.at[i, "status"] != df.at[i, "status"]] if changed is not df else []
    if not moved:
        return counts
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    for i in moved:
        row = json.loads(lines[i])
        row.update(status=Status.WARN.value, demoted_from=Status.ERROR.value, message=changed.at[i, "message"])
        lines[i] = json.dumps(row)
    path.write_text("\n".join(lines) + "\n")
    counts = {
        **counts,
        Status.ERROR: counts.get(Status.ERROR, 0) - len(moved),
        Status.WARN: counts.get(Status.WARN, 0) + len(moved),
    }
    meta_path = run_dir / RUN_META
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        write_json(meta_path, {**meta, "summary": {str(k): v for k, v in counts.items()}})
    return counts
