"""`shardcheck compare BASE NEW`: the regression gate between two runs.

Rows are matched by op, case, topology, dtype, device and check, on what both runs selected
(reports/selection.py: ops, cases, world sizes, dtypes, devices, --bench; one line says what only one side ran).
A regression is:
- a check that passed in BASE (`pass`, or `xpass`: a known failure that passed) and fails, errors or warns in
  NEW (a new finding, e.g. extra collectives), or is a known failure there (`xfail`): a KnownFailure mark
  acknowledges a failure, it does not undo it, so a check that stops passing is a regression whether or not
  NEW marks it;
- a slowdown beyond --max-slowdown percent that is also larger than the measured spread
  (the IQRs of both runs added), so noise alone does not trip it;
- peak memory growth beyond --max-memory-growth percent (memory is deterministic);
- a check that passed in BASE, that NEW selected and did not run (an op whose signature drifted runs none of its
  cases): one line per op, "N checks of BASE not run in NEW".
A new failure is a check NEW has and BASE has not that fails the run (fail, error, xpass).  Regressions and new
failures both make compare exit 1.

Timings compare only on the same machine (run.json `machine`: CPU model, core count, GPU): when BASE and NEW come
from different machines, compare says so and judges memory, collectives and statuses only.

Other changes of a known failure get a line without being regressions: xfail -> xpass (the known failure now
passes: NEW itself fails on it until the mark goes), xfail -> pass (fixed, mark removed), xfail -> fail or
error (still failing, no longer marked), a failure newly marked (fail -> xfail), a mark added over a passing
check (pass -> xpass).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from shardcheck.harness.core.compare import FAILING
from shardcheck.harness.core.records import RUN_META, Status, load, machine_label, same_machine, with_mesh_splits
from shardcheck.reports.selection import Selection, only_one_side

KEY = ["op", "case_id", "dp", "dp_replicate", "ep", "cp", "tp", "dtype", "device", "check"]
PASSED = (Status.PASS, Status.XPASS)  # the check's results were right
STOPPED_PASSING = (Status.XFAIL, Status.WARN, Status.FAIL, Status.ERROR)  # from PASSED to one of these: a regression
KNOWN_FAILURE_CHANGES = {  # (BASE, NEW) status -> what a person should read; none of them a regression
    (Status.XFAIL, Status.XPASS): "known failure now passes: remove its KnownFailure mark",
    (Status.XFAIL, Status.PASS): "known failure fixed",
    (Status.XFAIL, Status.FAIL): "known failure no longer marked",
    (Status.XFAIL, Status.ERROR): "known failure no longer marked, now an error",
    (Status.FAIL, Status.XFAIL): "now marked as a known failure",
    (Status.ERROR, Status.XFAIL): "now marked as a known failure",
    (Status.PASS, Status.XPASS): "a KnownFailure mark now covers this passing check",
    (Status.XPASS, Status.PASS): "KnownFailure mark removed",
}


def _with_defaults(df: pd.DataFrame) -> pd.DataFrame:
    for col in ("time_ms", "time_ms_iqr", "peak_bytes"):
        if col not in df:
            df[col] = float("nan")
    return with_mesh_splits(df)


def run_machine(path) -> dict | None:
    """run.json's `machine` of a run directory (None: not a single run's directory, or not recorded)."""
    meta = Path(path) / RUN_META
    try:
        return json.loads(meta.read_text()).get("machine") if meta.is_file() else None
    except (OSError, ValueError):
        return None


def machine_note(base_dir, new_dir) -> str | None:
    """A line when BASE and NEW ran on different machines (their timings are then not judged), else None."""
    base, new = run_machine(base_dir), run_machine(new_dir)
    if same_machine(base, new) is False:
        return (
            f"timings come from different machines (BASE: {machine_label(base)}; NEW: {machine_label(new)}): "
            "not compared; memory, collectives and statuses judged only"
        )
    return None


def change_notes(
    base: dict, new: dict, max_slowdown: float, max_memory_growth: float, judge_time: bool = True
) -> list[str]:
    """The rule, for one check in two runs (dicts with status, time_ms, time_ms_iqr, peak_bytes):
    notes on what changed; those starting with 'REGRESSION' are regressions.  `judge_time` False (the runs'
    machines differ): times are left out.  The dashboard uses it too."""
    notes = []
    statuses = (base["status"], new["status"])
    if base["status"] in PASSED and new["status"] in STOPPED_PASSING:
        notes.append(
            f"REGRESSION: {base['status']} -> {new['status']}"  # a new finding too
            + (" (passed in BASE, a known failure in NEW)" if new["status"] == Status.XFAIL else "")
        )
    elif statuses in KNOWN_FAILURE_CHANGES:
        notes.append(f"{base['status']} -> {new['status']}: {KNOWN_FAILURE_CHANGES[statuses]}")
    tb, tn = base["time_ms"], new["time_ms"]
    if judge_time and pd.notna(tb) and pd.notna(tn) and tb > 0:
        change = (tn / tb - 1) * 100
        spread = _or0(base["time_ms_iqr"]) + _or0(new["time_ms_iqr"])
        if change > max_slowdown and tn - tb > spread:
            notes.append(f"REGRESSION: time +{change:.0f}% ({tb:.3g} -> {tn:.3g} ms, spread {spread:.2g} ms)")
        elif abs(change) > max_slowdown:
            notes.append(f"time {change:+.0f}%" + (" (within spread)" if change > 0 else ""))
    mb, mn = base["peak_bytes"], new["peak_bytes"]
    if pd.notna(mb) and pd.notna(mn) and mb > 0:
        growth = (mn / mb - 1) * 100
        if growth > max_memory_growth:
            notes.append(f"REGRESSION: memory +{growth:.0f}% ({mb:.0f} -> {mn:.0f} B)")
        elif growth != 0:
            notes.append(f"memory {growth:+.0f}%")
    return notes


def _or0(value) -> float:
    return 0.0 if value is None or pd.isna(value) else float(value)


@dataclass
class StatusDiff:
    """Checks one run of two has and the other has not, judged: what compare and the dashboard count."""

    not_run: pd.DataFrame  # BASE's rows that passed, that NEW selected and did not run
    new_failing: pd.DataFrame  # NEW's rows that BASE has not, failing the run


def status_diff(base: pd.DataFrame, new: pd.DataFrame, key: list[str]) -> StatusDiff:
    base_keys, new_keys = pd.MultiIndex.from_frame(base[key]), pd.MultiIndex.from_frame(new[key])
    only_base = base[~base_keys.isin(new_keys)]
    only_new = new[~new_keys.isin(base_keys)]
    not_run = only_base[only_base["status"].isin(PASSED) & Selection.of(new).covers(only_base)]
    return StatusDiff(not_run=not_run, new_failing=only_new[only_new["status"].isin(FAILING)])


@dataclass
class Comparison:
    table: pd.DataFrame  # a row per changed check: status, time, memory, a failing new check
    regressions: int  # REGRESSION notes of the table, plus BASE's passing checks not run in NEW
    new_failures: int  # checks new in NEW that fail
    not_run: list[str]  # per op: "N checks of BASE not run in NEW"
    selection: str | None  # what only one side ran, when the runs' selections differ

    @property
    def failed(self) -> bool:
        return bool(self.regressions or self.new_failures)


def compare_runs(base_dir, new_dir, max_slowdown: float, max_memory_growth: float) -> Comparison:
    """The changed checks of two runs and their counts; timings judged only when both runs come from the same
    machine (or either did not record it: runs older than the record)."""
    judge_time = machine_note(base_dir, new_dir) is None
    base = _with_defaults(load(base_dir))
    new = _with_defaults(load(new_dir))
    diff = status_diff(base, new, KEY)
    cols = KEY + ["status", "time_ms", "time_ms_iqr", "peak_bytes"]
    both = base[cols].merge(new[cols], on=KEY, how="inner", suffixes=("_base", "_new"))
    rows, regressions = [], 0
    for _, r in both.iterrows():
        pair = [{k: r[f"{k}_{side}"] for k in cols[len(KEY) :]} for side in ("base", "new")]
        notes = change_notes(*pair, max_slowdown, max_memory_growth, judge_time)
        if notes:
            regressions += sum(n.startswith("REGRESSION") for n in notes)
            rows.append(_table_row(r, pair, "; ".join(notes)))
    for _, r in diff.new_failing.iterrows():
        new_row = {k: r[k] for k in cols[len(KEY) :]}
        rows.append(_table_row(r, [dict.fromkeys(new_row, float("nan")), new_row], f"NEW FAILURE: {r['status']}"))
    table = pd.DataFrame(rows, columns=KEY + ["base", "new", "time_ms", "peak_bytes", "change"])
    not_run = [
        f"{op}: {len(group)} check(s) of BASE not run in NEW (passed in BASE)"
        for op, group in diff.not_run.groupby("op", sort=True)
    ]
    return Comparison(
        table=table,
        regressions=regressions + len(diff.not_run),
        new_failures=len(diff.new_failing),
        not_run=not_run,
        selection=only_one_side(base, new),
    )


def _table_row(r: pd.Series, pair: list[dict], change: str) -> dict:
    base, new = pair
    return {
        **{k: r[k] for k in KEY},
        "base": base["status"] if isinstance(base["status"], str) else "",
        "new": new["status"],
        "time_ms": _pair(base["time_ms"], new["time_ms"]),
        "peak_bytes": _pair(base["peak_bytes"], new["peak_bytes"]),
        "change": change,
    }


def _pair(a, b) -> str:
    if pd.isna(a) and pd.isna(b):
        return ""
    fmt = lambda v: "" if pd.isna(v) else f"{v:.4g}"  # noqa: E731
    return f"{fmt(a)} -> {fmt(b)}"
