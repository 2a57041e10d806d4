"""A run's findings and failing items printed for the person at the terminal (the CLI's end of a run)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from shardcheck.harness.core.records import Status, Symptom, with_mesh_splits
from shardcheck.harness.findings.known import known_failures_line
from shardcheck.harness.findings.verdicts import Findings
from shardcheck.harness.findings.wording import few_checks, finding_lines
from shardcheck.reports.report import failing_items, folded_checks, item_title, skip_reason_lines


def print_findings(findings: Findings) -> None:
    """The run's non-passing rows grouped by cause (shardcheck.harness.findings.causes): one line per (op, cause);
    then the known failures (xfail) in one line with their reasons, and a rerun line for each."""
    table, known = findings.causes, findings.known
    if len(table):
        print(f"Findings ({len(table)}):")
        for line in finding_lines(table):
            print("  " + line)
    if len(known):
        print(known_failures_line(known))
        for r in known.itertuples():  # each known failure's rerun, as the findings have theirs
            if isinstance(r.rerun, str) and r.rerun:
                print(f"  rerun ({r.op}): {r.rerun}")


def print_skip_reasons(rows: pd.DataFrame, limit: int = 10) -> None:
    """Why the run skipped what it skipped: one line per distinct reason, counted (all of them in report.md)."""
    for line in skip_reason_lines(rows, limit):
        print("  " + line)


def print_harness_errors(rows: pd.DataFrame) -> None:
    """One line per place in shardcheck's own code that raised on a rank (Symptom.HARNESS): those errors are the
    harness's fault, not the op's."""
    bad = rows[(rows["status"] == Status.ERROR) & (rows["symptom"] == Symptom.HARNESS)]
    for (error_type, where), group in bad.groupby(["error_type", "error_where"], sort=False):
        items = len(
            with_mesh_splits(group).drop_duplicates(["op", "case_id", "dtype", "dp", "dp_replicate", "ep", "cp", "tp"])
        )
        print(
            f"shardcheck: {len(group)} error(s) in {items} item(s) are shardcheck's own fault, not the op's: "
            f"{error_type}: {group['error_message'].iloc[0]} raised at {where}; please report it"
        )


def print_failures(run_dir: Path, rows: pd.DataFrame, limit: int = 20) -> None:
    """Each failing item (a known failure that passes included): its bad checks, the first few of a long list (an
    error fails every check of its item with one message: report.md and results.jsonl keep them all), then a `rerun:`
    line that runs it alone."""
    items = failing_items(rows)
    for item in items[:limit]:
        print(item_title(item))
        for checks, _, message in folded_checks(item):
            print(f"  {few_checks(checks)}: {message}")
        if item["rerun"]:
            print(f"rerun: {item['rerun']}")
    if len(items) > limit:
        print(f"... and {len(items) - limit} more failing items (see {run_dir / 'report.md'})")
