"""report.md, a self-contained report.html and the agreement heatmap, from a run's records."""

from __future__ import annotations

import base64
import html
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: CI and laptops without a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.font_manager import FontProperties  # noqa: E402

from shardcheck.harness.core.compare import FAILING, STATUS_ORDER  # noqa: E402
from shardcheck.harness.core.records import SIGNATURE_CHECK, Status, with_mesh_splits  # noqa: E402
from shardcheck.harness.core.topology import topology_label, topology_name  # noqa: E402
from shardcheck.harness.findings.known import known_failure_text  # noqa: E402
from shardcheck.harness.findings.verdicts import SettledRun, read_settled  # noqa: E402
from shardcheck.harness.findings.wording import finding_lines  # noqa: E402
from shardcheck.reports import benchmark_json, png  # noqa: E402
from shardcheck.reports.error_map import draw_artefact  # noqa: E402
from shardcheck.reports.label_space import text_width  # noqa: E402
from shardcheck.reports.model_chart import model_charts  # noqa: E402

HEATMAP = "agreement_heatmap.png"
HEATMAP_LEGEND = "grey: planned, not judged (skip, XFAIL: known failure)\nwhite: not planned at that topology"
# The fields of a result row the pages read; every row `shardcheck run` writes has them (records.ROW_FIELDS).
REPORT_COLUMNS = ("op", "case_id", "dp", "cp", "tp", "dtype", "check", "status", "err_ratio", "message")


def uses_lines(df: pd.DataFrame) -> list[str]:
    """'- decoder.parallelize (its own decoder=...) calls cp_utils=..., model_utils=...': the module of every
    family each case that uses others (Case.uses) ran with, from its rows' `uses_impl`."""
    if "uses_impl" not in df:
        return []
    rows = df[df["uses_impl"].map(lambda u: isinstance(u, dict))].drop_duplicates("op")
    return [
        f"- {r['op']} (its own {r['family']}={r['impl']}) calls "
        + ", ".join(f"{fam}={spec}" for fam, spec in sorted(r["uses_impl"].items()))
        for r in rows.to_dict("records")
    ]


_TOPOLOGY_COLUMNS = ("dp", "cp", "tp", "ep", "dp_replicate")


def _topology(df: pd.DataFrame) -> pd.Series:
    """Each row's topology label (topology_label), worked out once per distinct mesh: a run has tens of thousands of
    rows over a dozen meshes, and `to_dict("records")` of every column cost seconds of the report."""
    columns = [df[c].tolist() if c in df else [None] * len(df) for c in _TOPOLOGY_COLUMNS]
    labels: dict[tuple, str] = {}
    out = []
    for key in zip(*columns):
        label = labels.get(key)
        if label is None:
            label = labels[key] = topology_label(dict(zip(_TOPOLOGY_COLUMNS, key)))
        out.append(label)
    return pd.Series(out, index=df.index, dtype=str)


def _worst(statuses: pd.Series) -> str:
    return max(statuses, key=STATUS_ORDER.__getitem__)


# A status's order (its worst-ness, STATUS_ORDER) back to the status; -1: only rows that do not count (a heatmap
# cell's skipped checks), a skip.
_STATUS_OF_ORDER = {float(order): status for status, order in STATUS_ORDER.items()} | {-1.0: Status.SKIP}


def _worst_by_cell(order: pd.Series, keys: list[pd.Series], empty: str) -> pd.DataFrame:
    """The worst status per cell of `keys` (the last key's values the columns; `empty` where a cell has no rows):
    a built-in groupby max of the statuses' orders, not a Python function per cell (pivot_table with such an
    aggfunc cost about a second of a small run's report under load)."""
    worst = order.groupby(keys).max().unstack()
    return worst.apply(lambda column: column.map(_STATUS_OF_ORDER)).fillna(empty)


def status_table(df: pd.DataFrame) -> pd.DataFrame:
    """op × dtype rows, topology columns; each cell the worst status over cases and checks."""
    order = df["status"].map(STATUS_ORDER)
    table = _worst_by_cell(order, [df["op"], df["dtype"], _topology(df).rename("topology")], empty="")
    table.columns.name = None
    return table.reset_index()


def skip_reasons(df: pd.DataFrame) -> pd.DataFrame:
    """One row per distinct reason the run skipped checks (a misfit, a missing extra, a hang's budget): the reason,
    its checks and its items, most checks first."""
    skipped = with_mesh_splits(df[df["status"] == Status.SKIP]).assign(
        reason=lambda d: d["message"].fillna("(no reason given)")
    )
    table = pd.DataFrame(
        {
            "checks": skipped.groupby("reason", sort=False).size(),
            "items": skipped.drop_duplicates([*ITEM_KEY, "reason"]).groupby("reason", sort=False).size(),
        }
    )
    return table.sort_values("checks", ascending=False, kind="stable").rename_axis("reason").reset_index()


def skip_reason_lines(df: pd.DataFrame, limit: int | None = None) -> list[str]:
    """'12 checks (4 items) skipped: <reason>' per distinct skip reason; past `limit` lines one that counts the rest."""
    table = skip_reasons(df)
    shown = table if limit is None else table.head(limit)
    lines = [
        f"{r.checks} checks ({r.items} items) skipped: {r.reason.removeprefix('skipped: ')}" for r in shown.itertuples()
    ]
    if len(table) > len(shown):
        rest = table.iloc[len(shown) :]
        lines.append(f"... {rest['checks'].sum()} checks skipped for {len(rest)} other reasons (see report.md)")
    return lines


def failures(df: pd.DataFrame) -> pd.DataFrame:
    """Every row that fails the run: fail, error, and xpass (a known failure that passes: its mark must go)."""
    bad = df[df["status"].isin(FAILING)].assign(topology=lambda d: _topology(d))
    return bad[["op", "case_id", "topology", "dtype", "check", "status", "message"]].reset_index(drop=True)


ITEM_KEY = ["op", "case_id", "dp", "dp_replicate", "ep", "cp", "tp", "dtype"]
MAX_LISTED_ITEMS = 200  # failing items listed one by one in the report (all are in results.jsonl)


def failing_items(df: pd.DataFrame) -> list[dict]:
    """One entry per item (op, case, topology, dtype) that fails the run (a check failed, errored or passed
    though marked as a known failure), in run order: its worst status, those checks (check, status, message,
    error map path or None) and its rerun command."""
    bad = with_mesh_splits(df[df["status"].isin(FAILING)])
    items = []
    for key, rows in bad.groupby(ITEM_KEY, sort=False):
        op, case_id, dp, dp_replicate, ep, cp, tp, dtype = key
        topology = topology_name(dp, cp, tp, ep, dp_replicate)
        signature = (rows["check"] == SIGNATURE_CHECK).all()  # checked before any rank runs: no topology, no dtype
        error_maps = rows["error_map"] if "error_map" in rows else pd.Series(None, index=rows.index)
        items.append(
            {
                "op": op,
                "case_id": case_id,
                "topology": topology,
                "dtype": dtype,
                "where": f"in the module under test {rows['impl'].iloc[0]}" if signature else f"{topology} {dtype}",
                "status": _worst(rows["status"]),
                "checks": [
                    (r["check"], r["status"], r["message"], m if isinstance(m, str) else None)
                    for (_, r), m in zip(rows.iterrows(), error_maps)
                ],
                "rerun": rows["rerun"].dropna().iloc[0] if "rerun" in rows and rows["rerun"].notna().any() else None,
            }
        )
    return items


def folded_checks(item: dict) -> list[tuple[str, str, str]]:
    """An item's bad checks as (checks, status, message), the checks that share a status and a message on one
    entry ("forward, grad:logits, property:comm"): a raise fails every check of its item with the same words."""
    groups: dict[tuple[str, str], list[str]] = {}
    for check, status, message, _ in item["checks"]:
        groups.setdefault((status, str(message)), []).append(check)
    return [(", ".join(checks), status, message) for (status, message), checks in groups.items()]


def item_title(item: dict) -> str:
    return f"{item['status'].upper()} {item['op']} [{item['case_id']}] {item['where']}"


def failures_markdown(items: list[dict], images: bool = True) -> list[str]:
    """Markdown lines: per failing item its checks, its `rerun:` line and (with `images`) its error maps."""
    lines = []
    for item in items[:MAX_LISTED_ITEMS]:
        lines += [f"### {item_title(item)}", ""]
        lines += [f"- `{checks}` {status}: {message}" for checks, status, message in folded_checks(item)]
        if item["rerun"]:
            lines += ["", "```text", f"rerun: {item['rerun']}", "```"]
        if images:
            lines += [f"![error map {check}]({path})" for check, _, _, path in item["checks"] if path]
        lines.append("")
    if len(items) > MAX_LISTED_ITEMS:
        lines.append(f"... and {len(items) - MAX_LISTED_ITEMS} more failing items (see results.jsonl)")
    return lines


def _failures_html(items: list[dict], run_dir: Path) -> str:
    parts = []
    for item in items[:MAX_LISTED_ITEMS]:
        parts.append(f"<div class='item'><h3 class='{item['status']}'>{html.escape(item_title(item))}</h3><ul>")
        parts += [
            f"<li><code>{html.escape(checks)}</code> <b>{status}</b>: {html.escape(message)}</li>"
            for checks, status, message in folded_checks(item)
        ]
        parts.append("</ul>")
        if item["rerun"]:
            parts.append(f"<pre class='rerun'>rerun: {html.escape(item['rerun'])}</pre>")
        for check, _, _, path in item["checks"]:
            if path and (run_dir / path).is_file():
                data = base64.b64encode((run_dir / path).read_bytes()).decode()
                parts.append(
                    f"<figure><img class='errmap' alt='error map {html.escape(check)}' "
                    f"src='data:image/png;base64,{data}'><figcaption>error map of <code>{html.escape(check)}</code>: "
                    f"|err| / budget, shard boundaries labelled by rank (tensors: "
                    f"<code>{html.escape(str(Path(path).with_suffix('.pt')))}</code>)</figcaption></figure>"
                )
        parts.append("</div>")
    if len(items) > MAX_LISTED_ITEMS:
        parts.append(f"<p>... and {len(items) - MAX_LISTED_ITEMS} more failing items (see results.jsonl)</p>")
    return "\n".join(parts)


COUNTED = [Status.PASS, Status.WARN, Status.FAIL, Status.ERROR, Status.SKIP, Status.XFAIL, Status.XPASS]


def known_failures_markdown(table: pd.DataFrame) -> list[str]:
    """The Known failures section: per KnownFailure its reason and reference, what it covered and a rerun line."""
    if not len(table):
        return []
    lines = [f"## Known failures ({int(table['count'].sum())} xfail rows, not failing the run)", ""]
    for r in table.itertuples():
        lines += [f"- **{known_failure_text(r)}**: {r.checks}; {r.count} row(s) in {r.items} item(s) {r.where}"]
        if isinstance(r.rerun, str):
            lines += ["", "  ```text", f"  rerun: {r.rerun}", "  ```"]
    return lines + [""]


def _known_failures_html(table: pd.DataFrame) -> str:
    if not len(table):
        return ""
    items = []
    for r in table.itertuples():
        reference = html.escape(r.reference)
        if r.reference.startswith(("http://", "https://")):
            reference = f"<a href='{reference}'>{reference}</a>"
        items.append(
            f"<li class='xfail'><b>XFAIL</b> <code>{html.escape(r.op)}</code>: {html.escape(r.reason)}"
            + (f" ({reference})" if r.reference else "")
            + f"<br><small>{html.escape(r.checks)}; {r.count} row(s) in {r.items} item(s) "
            f"{html.escape(r.where)}</small>"
            + (f"<pre class='rerun'>rerun: {html.escape(r.rerun)}</pre>" if isinstance(r.rerun, str) else "")
            + "</li>"
        )
    return (
        f"<h2>Known failures ({int(table['count'].sum())} xfail rows, not failing the run)</h2>"
        f"<ul class='findings'>{''.join(items)}</ul>"
    )


def findings_markdown(table: pd.DataFrame) -> list[str]:
    """The Findings section of a run's causes table (shardcheck.harness.findings.causes): one entry per (op, cause),
    failures before warnings."""
    if not len(table):
        return ["## Findings", "", "None: every check passed.", ""]
    return [f"## Findings ({len(table)})", "", "```text", *finding_lines(table), "```", ""]


def _findings_html(table: pd.DataFrame) -> str:
    if not len(table):
        return "<h2>Findings</h2><p>None: every check passed.</p>"
    items = []
    for r in table.itertuples():
        items.append(
            f"<li class='{r.status}'><b>{r.status.upper()}</b> <code>{html.escape(r.op)}</code>: "
            f"{html.escape(r.kind)} — {html.escape(r.condition)}; {html.escape(r.checks)}; {r.count} row(s)"
            + (
                f" <small>[{html.escape(r.rule)}]</small>"
                if isinstance(getattr(r, "rule", None), str) and r.rule
                else ""
            )
            + f"<br><small>worst: {html.escape(r.worst)}</small>"
            + (f"<pre class='rerun finding'>rerun: {html.escape(r.rerun)}</pre>" if isinstance(r.rerun, str) else "")
            + "</li>"
        )
    return f"<h2>Findings ({len(table)})</h2><ul class='findings'>" + "".join(items) + "</ul>"


def summary_markdown(run: SettledRun, max_items: int = 30) -> str:
    """A short Markdown summary for CI pages (GITHUB_STEP_SUMMARY): counts, the status table, the
    first failing items with their rerun lines."""
    df, meta, run_dir = run.rows, run.meta, run.run_dir
    counts = df["status"].value_counts().reindex(COUNTED, fill_value=0)
    items = failing_items(df)
    mark = "❌" if counts[list(FAILING)].any() else "⚠️" if counts[Status.WARN] else "✅"
    lines = [
        f"## {mark} shardcheck run {meta.get('run_id', run_dir.name)}",
        "",
        f"**{len(df)} checks: "
        + ", ".join(f"{n} {s}" for s, n in counts.items())
        + "**"
        + (f" (commit {str(meta['git_commit'])[:10]})" if meta.get("git_commit") else ""),
        "",
    ]
    lines += findings_markdown(run.findings.causes) + known_failures_markdown(run.findings.known)
    checks = df[df["check"] != "bench"]
    if len(checks):
        lines += [status_table(checks).to_markdown(index=False), ""]
    if items:
        lines += [f"### Failing items ({len(items)})", ""] + failures_markdown(items[:max_items], images=False)
        if len(items) > max_items:
            lines.append(f"... and {len(items) - max_items} more: see {run_dir / 'report.md'}")
    return "\n".join(lines) + "\n"


def heatmap_cells(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The heatmap's op × topology cells: the worst err/budget over dtypes, cases and checks (inf: a check fails
    the run; NaN: none judged), and each cell's label status, the worst of the checks that ran (skip only when none
    did; "" where nothing was planned). Built-in groupby aggregations, not a Python function per cell."""
    status = df["status"]
    ratio = df["err_ratio"].fillna(0.0).where(status == Status.PASS, np.nan)
    ratio = ratio.where(~status.isin(FAILING), np.inf).where(status != Status.WARN, df["err_ratio"].fillna(np.inf))
    keys = [df["op"], _topology(df).rename("topology")]
    grid = ratio.groupby(keys).max().unstack()
    ran = status.map(STATUS_ORDER).where(status != Status.SKIP, -1)  # a cell of skips only: -1, a skip
    labels = _worst_by_cell(ran, keys, empty="").reindex(index=grid.index, columns=grid.columns, fill_value="")
    return grid, labels


def _cell_text(status: str, ratio: float) -> str:
    if status == Status.PASS:
        return "" if np.isnan(ratio) else f"{ratio:.2g}"
    return status if status in ("", Status.SKIP) else status.upper()


_TICK_FONT = FontProperties(size=8)
_MARGIN = 0.15  # inches around the plot's outer texts


def _heatmap_figure(grid: pd.DataFrame) -> tuple[plt.Figure, plt.Axes, plt.Axes]:
    """A figure whose margins are worked out from its labels' widths: the same picture as a constrained layout
    gave, without its layout passes (~0.1-0.3 s a report)."""
    rows, columns = grid.shape
    slant = np.radians(30)  # the topology labels' rotation
    x_label = text_width(grid.columns, _TICK_FONT)
    left = _MARGIN + max(text_width(grid.index, _TICK_FONT) + 0.1, x_label * np.cos(slant) - 0.55)
    bottom = _MARGIN + x_label * np.sin(slant) + 0.15
    top, right = 0.6, 1.0  # the title's three lines; the colour bar, its ticks and its label
    width, height = max(1.1 * columns, 3.6), 0.45 * rows
    fig = plt.figure(figsize=(left + width + right, bottom + height + top))
    inches = fig.get_size_inches()
    ax = fig.add_axes((left / inches[0], bottom / inches[1], width / inches[0], height / inches[1]))
    bar = fig.add_axes(((left + width + 0.15) / inches[0], bottom / inches[1], 0.2 / inches[0], height / inches[1]))
    return fig, ax, bar


def heatmap(df: pd.DataFrame, path: Path) -> None:
    """op × topology coloured by the worst err/budget over dtypes, cases and checks; what fails the run (fail,
    error, xpass) is red, what was planned and not judged (skip, xfail) grey, what was never planned white; a cell
    whose worst check does not pass is labelled with its status."""
    grid, labels = heatmap_cells(df)
    values = grid.to_numpy(dtype=float)
    shown = np.log10(np.clip(np.nan_to_num(values, nan=np.nan, posinf=10.0), 1e-6, 10.0))  # NaN stays: grey
    fig, ax, bar = _heatmap_figure(grid)
    # Passing cells (ratio <= 1, log <= 0) span green to yellow; failing ones are red.
    norm = matplotlib.colors.TwoSlopeNorm(vmin=-6, vcenter=0, vmax=1)
    cmap = matplotlib.colormaps["RdYlGn_r"].with_extremes(bad="#d9d9d9")
    im = ax.imshow(np.ma.masked_invalid(shown), cmap=cmap, norm=norm, aspect="auto")
    # A cell no item was planned at (the case does not run at that topology) is white, apart from the grey of what
    # was planned and not judged (skipped, known failure).
    unplanned = (labels == "").to_numpy()
    white = matplotlib.colors.ListedColormap(["white"])
    ax.imshow(np.ma.masked_where(~unplanned, np.zeros(unplanned.shape)), cmap=white, aspect="auto")
    for (i, j), v in np.ndenumerate(values):
        ax.text(j, i, _cell_text(labels.iat[i, j], v), ha="center", va="center", fontsize=7, color="black")
    ax.set_xticks(range(len(grid.columns)), grid.columns, rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(len(grid.index)), grid.index, fontsize=8)
    ax.set_title(f"worst err / budget (≤ 1 passes)\n{HEATMAP_LEGEND}", fontsize=8)
    fig.colorbar(im, cax=bar, label="log10(err / budget)")
    png.save(fig, path, dpi=90)


def bench_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per benchmark: time (median ± IQR of the per-iteration max over ranks), memory, collectives."""
    b = df[df["check"] == "bench"].assign(topology=lambda d: _topology(d))
    mib = 2**20
    table = pd.DataFrame(
        {
            "op": b["op"],
            "case": b["case_id"],
            "topology": b["topology"],
            "dtype": b["dtype"],
            "time ms": b["time_ms"].map("{:.3f}".format) + " ± " + b["time_ms_iqr"].map("{:.2f}".format),
            "fwd ms": b["time_fwd_ms"].map("{:.3f}".format),
            "bwd ms": b["time_bwd_ms"].map("{:.3f}".format),
            "peak MiB": (b["peak_bytes"] / mib).map("{:.2f}".format),
            "fwd peak MiB": (b["peak_bytes_fwd"] / mib).map("{:.2f}".format),
            # the case's model of its peak (Case.memory): a gap is a tracker error or a tensor the op should not make
            "model MiB": (_column(b, "expected_peak_bytes") / mib).map(lambda v: "" if pd.isna(v) else f"{v:.2f}"),
            "peak / model": (b["peak_bytes"] / _column(b, "expected_peak_bytes")).map(
                lambda v: "" if pd.isna(v) else f"{v:.2f}x" + (" (!)" if _off_model(v) else "")
            ),
            "ref ms": b.get("ref_time_ms", pd.Series(index=b.index, dtype=float)).map(
                lambda v: "" if pd.isna(v) else f"{v:.3f}"
            ),
            "vs ref": (b["time_ms"] / b.get("ref_time_ms", pd.Series(index=b.index, dtype=float))).map(
                lambda v: "" if pd.isna(v) else f"{v:.2f}x"
            ),
            "collectives fwd / bwd": b["comm_calls"].map(_comm_text),
        }
    )
    return table.reset_index(drop=True)


def _column(df: pd.DataFrame, name: str) -> pd.Series:
    """A numeric column that only some rows (or none) have: NaN where absent."""
    return pd.to_numeric(df[name], errors="coerce") if name in df else pd.Series(float("nan"), index=df.index)


MODEL_BAND = (2 / 3, 1.5)  # measured / modelled peak outside it is flagged: our ops' models hold within 10 %


def _off_model(ratio: float) -> bool:
    return not MODEL_BAND[0] <= ratio <= MODEL_BAND[1]


def memory_gaps(df: pd.DataFrame) -> list[str]:
    """Bench rows whose measured peak is outside MODEL_BAND × the case's memory model, in words: what the model
    counted, and whether the gap exceeds what the forward saves for the backward."""
    b = df[df["check"] == "bench"]
    expected = _column(b, "expected_peak_bytes")
    lines = []
    for (_, r), e in zip(b.iterrows(), expected):
        if pd.isna(e) or e <= 0 or not _off_model(r["peak_bytes"] / e):
            continue
        gap = r["peak_bytes"] - e
        saved = r.get("saved_bytes")
        beyond = (
            ""
            if pd.isna(saved)
            else (f" (more than the saved-for-backward tensors, {saved / 2**20:.2f} MiB)" if abs(gap) > saved else "")
        )
        lines.append(
            f"{r['op']} [{r['case_id']}] dp{r['dp']}-cp{r['cp']}-tp{r['tp']} {r['dtype']}: measured "
            f"{r['peak_bytes'] / 2**20:.2f} MiB, model {e / 2**20:.2f} MiB ({r.get('memory_model', '')}): "
            f"{r['peak_bytes'] / e:.2f}x{beyond}"
        )
    return lines


def _comm_text(calls) -> str:
    if not isinstance(calls, dict):
        return ""
    return " / ".join(
        ", ".join(f"{n}×{k}" for k, n in calls.get(p, {}).items()) or "-" for p in ("forward", "backward")
    )


MESH_AXES = ("dp", "cp", "tp")  # a sweep over a mesh dim: x is the topology's size there


def sweep_lines(rows: pd.DataFrame, axis: str) -> pd.Series:
    """Each bench row's line in the sweep over `axis`: op, topology (over a mesh dim: only its ep and dp_replicate,
    so that dp4 and dp4-ep2 stay two lines), dtype."""
    if axis in MESH_AXES:
        rows = with_mesh_splits(rows)
        where = [
            " ".join([f"ep{ep}"] * (ep != 1) + [f"r{r}"] * (r != 1)) for ep, r in zip(rows["ep"], rows["dp_replicate"])
        ]
        topology = pd.Series(where, index=rows.index, dtype=str)
    else:
        topology = _topology(rows)
    parts = zip(rows["op"].str.split(".").str[-1], topology, rows["dtype"])
    return pd.Series([" ".join(filter(None, p)) for p in parts], index=rows.index, dtype=str)


def sweep_plots(df: pd.DataFrame, run_dir: Path) -> list[Path]:
    """Time and peak memory against each swept parameter (params['sweep']), one line per op and topology."""
    # (a sweep naming no number of its params is refused at planning; rows of older runs are left out)
    b = df[
        (df["check"] == "bench")
        & df["params"].map(
            lambda p: (
                isinstance(p, dict)
                and isinstance(p.get("sweep"), str)
                and (p["sweep"] in MESH_AXES or isinstance(p.get(p["sweep"]), (int, float)))
            )
        )
    ]
    paths = []
    for axis, rows in b.groupby(b["params"].map(lambda p: p["sweep"])):
        x = rows[axis] if axis in MESH_AXES else rows["params"].map(lambda p, axis=axis: p[axis])
        rows = rows.assign(x=x.astype(float), line=sweep_lines(rows, axis))
        fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
        for line, g in rows.sort_values("x").groupby("line"):
            ax_t.errorbar(g["x"], g["time_ms"], yerr=g["time_ms_iqr"] / 2, marker="o", capsize=3, label=line)
            ax_m.plot(g["x"], g["peak_bytes"] / 2**20, marker="o", label=line)
        for ax, ylabel in ((ax_t, "time ms (median, IQR bars)"), (ax_m, "peak MiB (fwd+bwd, max over ranks)")):
            ax.set_xlabel(axis)
            ax.set_ylabel(ylabel)
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
        ax_m.legend(fontsize=7)
        fig.suptitle(f"scaling with {axis}", fontsize=10)
        path = run_dir / f"sweep_{axis}.png"
        png.save(fig, path, dpi=100)
        paths.append(path)
    return paths


def draw_error_maps(df: pd.DataFrame, run_dir: Path) -> None:
    """The error map of each check with a failure artefact (harness/rank/artefacts.py), where it is not drawn yet."""
    if "artefact" not in df:
        return
    for _, row in df[df["artefact"].map(lambda a: isinstance(a, str))].iterrows():
        png = run_dir / (
            row["error_map"] if isinstance(row.get("error_map"), str) else Path(row["artefact"]).with_suffix(".png")
        )
        if not png.is_file() and (run_dir / row["artefact"]).is_file():
            mismatch = row["mismatch"] if isinstance(row.get("mismatch"), dict) else {}
            draw_artefact(run_dir / row["artefact"], png, worst=mismatch.get("global_index"))


def build(run_dir: str | Path) -> list[Path]:
    """(Re)build the report files of one run directory from its records (`shardcheck report`): the pages, the
    plots and the benchmark JSON."""
    run = read_settled(Path(run_dir))
    paths = write(run)
    benchmark_json.write(run.run_dir, run.rows, run.meta)
    return paths


def write(run: SettledRun) -> list[Path]:
    """report.md, report.html and their plots, from a settled run; the paths written."""
    df, meta, run_dir = run.rows, run.meta, run.run_dir
    draw_error_maps(df, run_dir)
    counts = df["status"].value_counts().reindex(COUNTED, fill_value=0)
    bad = failures(df)
    checks = df[df["check"] != "bench"]
    table = status_table(checks) if len(checks) else pd.DataFrame()
    images = []
    if len(checks):
        heatmap(checks, run_dir / HEATMAP)
        images.append(("Agreement", run_dir / HEATMAP))
    bench = bench_table(df) if (df["check"] == "bench").any() else pd.DataFrame()
    images += [(p.stem.replace("_", " "), p) for p in sweep_plots(df, run_dir)] if len(bench) else []
    images += model_charts(checks, run_dir) if len(checks) else []  # where a failing model case leaves the one device

    header = [f"# shardcheck run {meta.get('run_id', run_dir.name)}", ""]
    for key in ("git_commit", "git_dirty", "torch_version", "device", "device_name", "backend", "host", "start", "end"):
        if key in meta:
            header.append(f"- {key}: {meta[key]}")
    header += [f"- {note}" for note in meta.get("shim_notes", [])]  # CPU shims the run used (harness/shims)
    if meta.get("impl"):  # each family's module under test, the families a model case uses included
        header.append(
            "- modules under test: " + ", ".join(f"{fam}={spec}" for fam, spec in sorted(meta["impl"].items()))
        )
    header += uses_lines(df)
    summary = ", ".join(f"{n} {s}" for s, n in counts.items())
    findings, known = run.findings.causes, run.findings.known
    md = header + ["", f"**{len(df)} checks: {summary}**", ""] + findings_markdown(findings)
    reasons = skip_reason_lines(df)
    md += ["## Skipped", ""] + [f"- {line}" for line in reasons] + [""] if reasons else []
    md += known_failures_markdown(known)
    if len(table):
        md += ["## Status: op × dtype × topology", "", table.to_markdown(index=False), ""]
    gaps = memory_gaps(df) if len(bench) else []
    if len(bench):
        md += ["## Benchmarks", "", bench.to_markdown(index=False), ""]
        if gaps:
            md += (
                ["Peak memory off the op's memory model (beyond 1.5×, or under 2/3 of it):", ""]
                + [f"- {g}" for g in gaps]
                + [""]
            )
    md += [f"![{title}]({path.name})" for title, path in images]
    items = failing_items(df)
    md += ["", "## Failures", "", bad.to_markdown(index=False) if len(bad) else "None."]
    if items:
        md += ["", f"## Failing items ({len(items)}): rerun lines and error maps", ""] + failures_markdown(items)
    (run_dir / "report.md").write_text("\n".join(md) + "\n")

    style = (
        "body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;font-size:13px}"
        "td,th{border:1px solid #ccc;padding:3px 6px}td.pass{background:#dfd}td.fail{background:#fbb}"
        "td.error{background:#f88;font-weight:bold}td.skip{background:#eee}td.warn{background:#fe9}"
        "td.xfail{background:#dde4f4}td.xpass{background:#f9c;font-weight:bold}"
        "ul.findings li{margin-bottom:6px}li.warn b{color:#a60}li.fail b{color:#b00}li.error b{color:#700}"
        "li.xfail b{color:#446}li.xpass b{color:#b06}"
        "div.item{border-top:1px solid #ccc;margin-top:1em}h3.fail{color:#b00}h3.error{color:#700}h3.xpass{color:#b06}"
        "pre.rerun{background:#f4f4f4;padding:6px;white-space:pre-wrap;font-size:12px}"
        "img.errmap{max-width:1000px;border:1px solid #ddd}figcaption{font-size:12px;color:#555}"
    )
    cells = table.to_html(index=False, escape=True) if len(table) else ""
    for status in STATUS_ORDER:
        cells = cells.replace(f"<td>{status}</td>", f'<td class="{status}">{status}</td>')
    pictures = "".join(
        f"<h2>{html.escape(title)}</h2><img alt='{html.escape(title)}' "
        f"src='data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()}'>"
        for title, path in images
    )
    page = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>shardcheck {html.escape(meta.get('run_id', ''))}</title>",
        f"<style>{style}</style></head><body>",
        f"<h1>shardcheck run {html.escape(meta.get('run_id', run_dir.name))}</h1>",
        "<ul>" + "".join(f"<li>{html.escape(line[2:])}</li>" for line in header[2:]) + "</ul>",
        f"<p><b>{len(df)} checks: {html.escape(summary)}</b></p>",
        _findings_html(findings),
        _known_failures_html(known),
        "<h2>Status: op × dtype × topology</h2>" + cells if cells else "",
        "<h2>Benchmarks</h2>" + bench.to_html(index=False, escape=True) if len(bench) else "",
        (
            "<p>Peak memory off the op's memory model (beyond 1.5×, or under 2/3 of it):</p><ul>"
            + "".join(f"<li>{html.escape(g)}</li>" for g in gaps)
            + "</ul>"
        )
        if gaps
        else "",
        pictures,
        "<h2>Failures</h2>",
        bad.to_html(index=False, escape=True) if len(bad) else "<p>None.</p>",
        f"<h2>Failing items ({len(items)}): rerun lines and error maps</h2>" + _failures_html(items, run_dir)
        if items
        else "",
        "</body></html>",
    ]
    (run_dir / "report.html").write_text("\n".join(page))
    return [run_dir / "report.md", run_dir / "report.html"] + [p for _, p in images]
