"""`shardcheck dashboard RUN_DIR...`: one self-contained HTML page over a history of runs.

Runs are ordered by start time and labelled by git commit.  Per op and benchmark case, one
figure: median time with its interquartile band, and peak memory, across runs; one line per
(topology, dtype, device), so runs from different devices or dtypes are never mixed in a line.
A point where compare's rule (reports/regression.change_notes, against the line's previous run)
flags a regression is marked; a time is judged only against a run of the same machine (run.json `machine`:
CPU model, core count, GPU), the page says when its runs come from several.  Pass/fail counts per run head the page.
Reads only what shardcheck.harness.core.records.load reads, plus run.json for start time, commit, device name and
machine.
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from shardcheck.harness.core.records import (  # noqa: E402
    MACHINE_KEYS,
    RUN_META,
    Status,
    load,
    machine_label,
    with_mesh_splits,
)
from shardcheck.harness.core.topology import topology_name  # noqa: E402
from shardcheck.reports import png  # noqa: E402
from shardcheck.reports.regression import PASSED, change_notes, status_diff  # noqa: E402

DASHBOARD = "dashboard.html"
# ep and dp_replicate in the keys: two topologies differing only there are two lines, never one
LINE_KEY = ["dp", "cp", "tp", "ep", "dp_replicate", "dtype", "device", "device_name"]
CHECK_KEY = ["op", "case_id", "dp", "cp", "tp", "ep", "dp_replicate", "dtype", "device", "device_name", "check"]
STATUSES = [Status.PASS, Status.WARN, Status.FAIL, Status.ERROR, Status.SKIP, Status.XFAIL, Status.XPASS]
STATUS_COLOURS = {
    "pass": "#4caf50",
    "warn": "#ffb300",
    "fail": "#e53935",
    "error": "#8e0000",
    "skip": "#bdbdbd",
    "xfail": "#7986cb",
    "xpass": "#d81b60",
}


def load_runs(run_dirs: list[Path]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(runs, rows): one line per run, ordered by start time, with its label; every row with its run's index."""
    runs, frames = [], []
    for d in run_dirs:
        d = Path(d)
        meta = json.loads((d / RUN_META).read_text()) if (d / RUN_META).is_file() else {}
        df = load(d)
        run_id = meta.get("run_id") or (str(df["run_id"].iloc[0]) if "run_id" in df else d.name)
        runs.append(
            {
                "run_id": run_id,
                "dir": str(d),
                "start": meta.get("start") or "",
                "commit": (meta.get("git_commit") or "")[:8] + ("+dirty" if meta.get("git_dirty") else ""),
                "device_name": meta.get("device_name") or "",
                "backend": meta.get("backend") or "",
                "machine": machine_label(meta.get("machine")),
            }
        )
        frames.append(
            df.assign(
                run_dir=str(d), device_name=meta.get("device_name") or "", machine_key=_machine_key(meta.get("machine"))
            )
        )
    runs = pd.DataFrame(runs).sort_values(["start", "run_id"], kind="stable").reset_index(drop=True)
    runs["index"] = range(len(runs))
    runs["label"] = [f"{r.commit or 'no commit'}\n{r.start.replace('T', ' ')[5:16]}" for r in runs.itertuples()]
    rows = with_mesh_splits(pd.concat(frames, ignore_index=True))  # runs before ep or HSDP: 1
    rows["run"] = rows["run_dir"].map(dict(zip(runs["dir"], runs["index"])))
    for col in ("time_ms", "time_ms_iqr", "peak_bytes"):
        if col not in rows:
            rows[col] = np.nan
    return runs, rows


def _machine_key(machine: dict | None) -> str:
    """The hardware a run's timings come from, as one string ("" when the run did not record it)."""
    return json.dumps([machine.get(k) for k in MACHINE_KEYS]) if machine else ""


def status_counts(runs: pd.DataFrame, rows: pd.DataFrame) -> pd.DataFrame:
    """Per run: the count of each status of its checks (bench rows included); `new failures`: the checks that
    passed in their latest earlier run (of the same device) and now fail, error or are known failures, and those
    new in this run that fail it; `not run`: those that passed in their latest earlier run, that this run selected
    and did not run (compare's rule, reports/regression.py)."""
    counts = rows.groupby("run")["status"].value_counts().unstack(fill_value=0).reindex(columns=STATUSES, fill_value=0)
    counts = counts.reindex(runs["index"], fill_value=0)
    table = runs[["index", "run_id", "start", "commit", "device_name", "machine"]].join(counts, on="index")
    changes = [_new_failures(rows, i) for i in runs["index"]]
    table["new failures"] = [failures for failures, _ in changes]
    table["not run"] = [not_run for _, not_run in changes]
    return table


def _new_failures(rows: pd.DataFrame, run: int) -> tuple[int, int]:
    """(new failures, passing checks not run) of a run against the latest earlier status of each check."""
    if run == 0:
        return 0, 0
    now = rows[rows["run"] == run]
    before = rows[rows["run"] < run].sort_values("run", kind="stable").drop_duplicates(CHECK_KEY, keep="last")
    both = before.merge(now, on=CHECK_KEY, suffixes=("_before", "_now"))
    stopped = both["status_before"].isin(PASSED) & both["status_now"].isin([Status.FAIL, Status.ERROR, Status.XFAIL])
    diff = status_diff(before, now, CHECK_KEY)
    return int(stopped.sum()) + len(diff.new_failing), len(diff.not_run)


def _band(row) -> tuple[float, float, float]:
    """(median, q1, q3) of a bench row: from its per-iteration times when recorded, else median ± IQR/2."""
    times = row.get("times_ms")
    if isinstance(times, list) and times:
        q1, med, q3 = np.percentile(times, [25, 50, 75])
        return float(row["time_ms"]), float(q1), float(q3)
    iqr = row["time_ms_iqr"] if pd.notna(row["time_ms_iqr"]) else 0.0
    return float(row["time_ms"]), float(row["time_ms"] - iqr / 2), float(row["time_ms"] + iqr / 2)


def regressions(rows: pd.DataFrame, max_slowdown: float, max_memory_growth: float) -> pd.DataFrame:
    """Each bench point that compare's rule flags against the previous run of its line."""
    bench = rows[rows["check"] == "bench"].sort_values("run")
    found = []
    for key, line in bench.groupby(["op", "case_id", *LINE_KEY], sort=False):
        previous = None
        for _, r in line.iterrows():
            if previous is not None:
                # times from two machines do not compare: memory (and statuses) only
                judge_time = not (
                    previous["machine_key"] and r["machine_key"] and previous["machine_key"] != r["machine_key"]
                )
                notes = [
                    n
                    for n in change_notes(previous, r, max_slowdown, max_memory_growth, judge_time)
                    if n.startswith("REGRESSION")
                ]
                if notes:
                    found.append(
                        {
                            **dict(zip(["op", "case_id", *LINE_KEY], key)),
                            "run": int(r["run"]),
                            "note": "; ".join(n.removeprefix("REGRESSION: ") for n in notes),
                        }
                    )
            previous = r
    return pd.DataFrame(found, columns=["op", "case_id", *LINE_KEY, "run", "note"])


def machines_html(runs: pd.DataFrame, rows: pd.DataFrame) -> str:
    """A warning when the runs' timings come from more than one machine (machines here differ about 2×)."""
    known = sorted(set(rows["machine_key"]) - {""}) if "machine_key" in rows else []
    if len(known) < 2:
        return ""
    labels = sorted(set(runs["machine"]) - {"machine not recorded"})
    return (
        f"<p><b>These runs come from {len(known)} machines</b> ({html.escape('; '.join(labels))}): a time is "
        "not judged against a previous run from another machine; memory, collectives and "
        "statuses across all.  Read the time plots per machine (the Runs table names each run's).</p>"
    )


def _png(fig) -> str:
    buf = io.BytesIO()
    png.save(fig, buf, dpi=90)
    return base64.b64encode(buf.getvalue()).decode()


def _line_name(key: tuple) -> str:
    dp, cp, tp, ep, dp_replicate, dtype, device, device_name = key
    return f"{topology_name(dp, cp, tp, ep, dp_replicate)} {dtype} {device}" + (
        f" ({device_name})" if device_name else ""
    )


def bench_figure(op: str, case_id: str, rows: pd.DataFrame, runs: pd.DataFrame, marks: pd.DataFrame) -> str:
    """Time (median, IQR band) and peak memory of one op and benchmark case across runs, base64 PNG."""
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 3.2), layout="constrained")
    for key, line in rows.groupby(LINE_KEY, sort=True):
        line = line.sort_values("run")
        x = line["run"].to_numpy()
        med, q1, q3 = (np.array(v) for v in zip(*(_band(r) for _, r in line.iterrows())))
        (drawn,) = ax_t.plot(x, med, marker="o", ms=4, label=_line_name(key))
        ax_t.fill_between(x, q1, q3, color=drawn.get_color(), alpha=0.2, lw=0)
        ax_m.plot(x, line["peak_bytes"] / 2**20, marker="o", ms=4, color=drawn.get_color())
        flagged = marks[(marks[LINE_KEY].astype(str) == pd.Series(key, index=LINE_KEY).astype(str)).all(axis=1)]
        for _, m in flagged.iterrows():
            r = line[line["run"] == m["run"]].iloc[0]
            axes = [ax_t] if "time" in m["note"] else []
            axes += [ax_m] if "memory" in m["note"] else []
            for ax in axes or [ax_t]:
                y = r["time_ms"] if ax is ax_t else r["peak_bytes"] / 2**20
                ax.plot([m["run"]], [y], marker="X", ms=13, color="red", mec="black", zorder=5)
                ax.annotate(
                    "regression", (m["run"], y), textcoords="offset points", xytext=(6, 6), fontsize=7, color="red"
                )
    for ax, ylabel in ((ax_t, "time ms (median, IQR band)"), (ax_m, "peak MiB (max over ranks)")):
        ax.set_xticks(runs["index"], runs["label"], fontsize=7)
        ax.set_xlim(-0.5, len(runs) - 0.5)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    ax_t.legend(fontsize=7, loc="best")
    fig.suptitle(f"{op} [{case_id}]", fontsize=10)
    return _png(fig)


def counts_figure(table: pd.DataFrame, runs: pd.DataFrame) -> str:
    fig, ax = plt.subplots(figsize=(11, 2.8), layout="constrained")
    bottom = np.zeros(len(table))
    for status in STATUSES:
        values = table[status].to_numpy(dtype=float)
        ax.bar(table["index"], values, bottom=bottom, color=STATUS_COLOURS[status], label=status)
        bottom += values
    ax.set_xticks(runs["index"], runs["label"], fontsize=7)
    ax.set_ylabel("checks", fontsize=8)
    ax.legend(fontsize=7, ncol=4)
    ax.set_title("checks per run by status", fontsize=10)
    return _png(fig)


def build_dashboard(
    run_dirs: list[Path], out_dir: Path, max_slowdown: float = 10.0, max_memory_growth: float = 5.0
) -> tuple[Path, int]:
    """Write out_dir/dashboard.html; returns (its path, number of regression marks)."""
    runs, rows = load_runs(run_dirs)
    table = status_counts(runs, rows)
    marks = regressions(rows, max_slowdown, max_memory_growth)
    bench = rows[(rows["check"] == "bench") & rows["time_ms"].notna()]
    style = (
        "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;font-size:13px}"
        "td,th{border:1px solid #ccc;padding:3px 6px}h2{margin-top:1.5em}img{max-width:100%}"
        "td.bad{background:#fbb;font-weight:bold}"
    )
    page = [
        "<!doctype html><html><head><meta charset='utf-8'><title>shardcheck dashboard</title>",
        f"<style>{style}</style></head><body><h1>shardcheck dashboard: {len(runs)} runs</h1>",
        f"<p>From {html.escape(str(runs['start'].iloc[0]))} to {html.escape(str(runs['start'].iloc[-1]))}. "
        f"Regression marks follow <code>shardcheck compare</code>'s rule against the previous run of the same line "
        f"(time beyond {max_slowdown:g}% and beyond the two runs' IQRs added; memory beyond {max_memory_growth:g}%; "
        f"a check that passed and now fails, or is marked as a known failure; a new check that fails; a passing "
        f"check this run selected and did not run).</p>",
        machines_html(runs, rows),
        "<h2>Runs</h2>",
        _table_html(table, bad_columns=(Status.FAIL, Status.ERROR, Status.XPASS, "new failures", "not run")),
        f"<img alt='checks per run' src='data:image/png;base64,{counts_figure(table, runs)}'>",
        f"<h2>Regressions ({len(marks)})</h2>",
    ]
    if len(marks):
        shown = marks.assign(run=marks["run"].map(lambda i: f"{i}: {runs['commit'][i]} {runs['start'][i]}"))
        page.append(_table_html(shown))
    else:
        page.append("<p>None.</p>")
    page.append(f"<h2>Benchmarks ({bench.groupby(['op', 'case_id']).ngroups} op × case)</h2>")
    if bench.empty:
        page.append("<p>No benchmark rows in these runs (run with <code>--bench</code>).</p>")
    for op, op_rows in bench.groupby("op", sort=True):
        page.append(f"<h3>{html.escape(op)}</h3>")
        for case_id, case_rows in op_rows.groupby("case_id", sort=True):
            case_marks = marks[(marks["op"] == op) & (marks["case_id"] == case_id)]
            png = bench_figure(op, case_id, case_rows, runs, case_marks)
            page.append(f"<img alt='{html.escape(op)} {html.escape(case_id)}' src='data:image/png;base64,{png}'>")
    page.append("</body></html>")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / DASHBOARD
    path.write_text("\n".join(page))
    return path, len(marks)


def _table_html(df: pd.DataFrame, bad_columns: tuple[str, ...] = ()) -> str:
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in df.columns)
    body = []
    for _, r in df.iterrows():
        cells = []
        for c in df.columns:
            bad = c in bad_columns and isinstance(r[c], (int, np.integer)) and r[c] > 0
            cells.append(f"<td{' class=bad' if bad else ''}>{html.escape(str(r[c]))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"
