"""JUnit XML of a run: one <testcase> per item (op, case, topology, dtype), one <testsuite> per op.

The testcase name reads well on a CI page ('b4s6v37-masked0.3 [dp1-cp1-tp2 float64]', class the
op); a failing or erroring item carries every bad check's message and its rerun line, its type the
exception's (`RuntimeError`) or what went wrong (`shardcheck.values`, `shardcheck.hung`); a skipped
one, its reason.  Items whose checks all pass are passes; an `error` anywhere makes the item an
error, else a `fail` a failure; an item whose checks were all skipped is skipped.  An item whose worst
check is a `warn` (a precision or communication finding, not a sharding bug) is a passing testcase
whose <system-out> holds each warning and its rerun line: CI pages show it without failing the build,
as `shardcheck run` exits 0 on warnings unless --strict (whose exit code then fails the job).

Known failures (shardcheck.KnownFailure), as JUnit readers expect of pytest's xfail: an item whose worst
check is `xfail` is skipped, <skipped type="shardcheck.xfail" message="known failure: <reason> (<reference>)">,
the findings it still shows in the text; an item with an `xpass` (the known failure now passes) is a failure,
type `shardcheck.xpass`, saying so and that the mark must go, with its rerun line.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pandas as pd

from shardcheck.harness.core.compare import FAILING, STATUS_ORDER
from shardcheck.harness.core.records import Status, with_mesh_splits
from shardcheck.harness.core.topology import topology_name

ITEM_KEY = ["op", "case_id", "dp", "dp_replicate", "ep", "cp", "tp", "dtype"]


def _item_status(statuses: pd.Series) -> str:
    worst = max(statuses, key=STATUS_ORDER.__getitem__)
    if worst == Status.SKIP and (statuses == Status.PASS).any():
        return Status.PASS  # a skipped property beside passing checks: the item passed
    return worst


def _known_failure(row: pd.Series) -> str:
    """'known failure: <reason> (<reference>)' of an xfail or xpass row."""
    reason = row.get("xfail_reason") if isinstance(row.get("xfail_reason"), str) else "?"
    reference = row.get("xfail_reference") if isinstance(row.get("xfail_reference"), str) else ""
    return f"known failure: {reason}" + (f" ({reference})" if reference else "")


def _rerun(rows: pd.DataFrame) -> str:
    return "\nrerun: " + rows["rerun"].dropna().iloc[0] if "rerun" in rows and rows["rerun"].notna().any() else ""


def _failure_type(row: pd.Series) -> str:
    """The exception's type for an exception, else what went wrong (shardcheck.harness.core.records.SYMPTOMS):
    shardcheck.values."""
    symptom = row.get("symptom")
    if symptom in ("exception", "reference") and isinstance(row.get("error_type"), str):
        return row["error_type"]
    return f"shardcheck.{symptom if isinstance(symptom, str) else row['status']}"


def junit_tree(df: pd.DataFrame, run_id: str) -> ET.ElementTree:
    root = ET.Element("testsuites", name=f"shardcheck {run_id}")
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "time": 0.0}
    for op, op_rows in df.groupby("op", sort=False):
        suite = ET.SubElement(root, "testsuite", name=op)
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "time": 0.0}
        for (_, case_id, dp, dp_replicate, ep, cp, tp, dtype), rows in with_mesh_splits(op_rows).groupby(
            ITEM_KEY, sort=False
        ):
            seconds = (
                float(rows["item_seconds"].max())
                if "item_seconds" in rows and rows["item_seconds"].notna().any()
                else 0.0
            )
            case = ET.SubElement(
                suite,
                "testcase",
                classname=op,
                name=f"{case_id} [{topology_name(dp, cp, tp, ep, dp_replicate)} {dtype}]",
                time=f"{seconds:.3f}",
            )
            status = _item_status(rows["status"])
            counts["tests"] += 1
            counts["time"] += seconds
            if status in FAILING:
                bad = rows[rows["status"].isin(FAILING)]
                first = bad[bad["status"] == status].iloc[0]  # the message and type: the item's worst check
                text = "\n".join(f"{r['check']}: {r['status']}: {r['message']}" for _, r in bad.iterrows()) + _rerun(
                    rows
                )
                tag = "error" if status == "error" else "failure"
                message = (
                    f"{first['check']}: {_known_failure(first)} now passes on every rank; remove its mark"
                    if first["status"] == Status.XPASS
                    else f"{first['check']}: {first['message']}"
                )
                element = ET.SubElement(case, tag, message=message[:1000], type=_failure_type(first))
                element.text = text
                counts["errors" if status == "error" else "failures"] += 1
            elif status == Status.WARN:
                noted = rows[rows["status"].isin([Status.WARN, Status.XFAIL])]  # a known failure beside it: shown too
                text = "\n".join(f"{r['status']}: {r['check']}: {r['message']}" for _, r in noted.iterrows())
                ET.SubElement(case, "system-out").text = text + _rerun(rows)
            elif status == Status.XFAIL:
                known = rows[rows["status"] == Status.XFAIL]
                element = ET.SubElement(
                    case, "skipped", type="shardcheck.xfail", message=_known_failure(known.iloc[0])[:1000]
                )
                element.text = "\n".join(f"{r['check']}: {r['message']}" for _, r in known.iterrows()) + _rerun(rows)
                counts["skipped"] += 1
            elif status == Status.SKIP:
                ET.SubElement(case, "skipped", message=str(rows["message"].iloc[0]))
                counts["skipped"] += 1
        for key, value in counts.items():
            suite.set(key, f"{value:.3f}" if key == "time" else str(value))
            totals[key] += value
    for key, value in totals.items():
        root.set(key, f"{value:.3f}" if key == "time" else str(value))
    ET.indent(root)
    return ET.ElementTree(root)


def write(df: pd.DataFrame, run_id: str, path: Path) -> Path:
    junit_tree(df, run_id).write(path, encoding="utf-8", xml_declaration=True)
    return path
