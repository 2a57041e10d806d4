"""JUnit XML of a run: one <testcase> per item (op, case, topology, dtype), one <testsuite> per op.

The testcase name reads well on a CI page ('b4s6v37-masked0.3 [dp1-cp1-tp2 float64]', class the
op); a failing or erroring item carries every bad check's message and its rerun line, its type the
exception's (`RuntimeError`) or what went wrong (`shardcheck.values`, `shardcheck.hung`); a skipped
one, its reason.  Items whose checks all pass are passes; an `error` anywhere makes the item an
error, else a `fail` a failure; an item whose checks were all skipped is skipped.  An item whose worst
check is a `warn` (a precision or communication finding, not a sharding bug) is a passing testcase
whose <system-out> holds each warning and its rerun line: CI pages show it without failing the build,
as `shardcheck run` exits 0 on warnings unless --strict (whose exit code then fails the job).
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pandas as pd

from harness.compare import STATUS_ORDER

ITEM_KEY = ["op", "case_id", "dp", "cp", "tp", "dtype"]


def _item_status(statuses: pd.Series) -> str:
    worst = max(statuses, key=STATUS_ORDER.__getitem__)
    if worst == "skip" and (statuses == "pass").any():
        return "pass"  # a skipped property beside passing checks: the item passed
    return worst


def _failure_type(row: pd.Series) -> str:
    """The exception's type for an exception, else what went wrong (harness.records.SYMPTOMS): shardcheck.values."""
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
        for (_, case_id, dp, cp, tp, dtype), rows in op_rows.groupby(ITEM_KEY, sort=False):
            seconds = float(rows["item_seconds"].max()) if "item_seconds" in rows and rows["item_seconds"].notna().any() else 0.0
            case = ET.SubElement(suite, "testcase", classname=op, name=f"{case_id} [dp{dp}-cp{cp}-tp{tp} {dtype}]",
                                 time=f"{seconds:.3f}")
            status = _item_status(rows["status"])
            counts["tests"] += 1
            counts["time"] += seconds
            if status in ("fail", "error"):
                bad = rows[rows["status"].isin(["fail", "error"])]
                first = bad.iloc[0]
                text = "\n".join(f"{r['check']}: {r['status']}: {r['message']}" for _, r in bad.iterrows())
                if "rerun" in rows and rows["rerun"].notna().any():
                    text += "\nrerun: " + rows["rerun"].dropna().iloc[0]
                tag = "failure" if status == "fail" else "error"
                element = ET.SubElement(case, tag, message=f"{first['check']}: {first['message']}"[:1000],
                                        type=_failure_type(first))
                element.text = text
                counts["failures" if status == "fail" else "errors"] += 1
            elif status == "warn":
                warned = rows[rows["status"] == "warn"]
                text = "\n".join(f"warn: {r['check']}: {r['message']}" for _, r in warned.iterrows())
                if "rerun" in rows and rows["rerun"].notna().any():
                    text += "\nrerun: " + rows["rerun"].dropna().iloc[0]
                ET.SubElement(case, "system-out").text = text
            elif status == "skip":
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
