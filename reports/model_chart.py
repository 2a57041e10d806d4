"""The per-module chart of a model case item: where the sharded model leaves the single-device one.

A model case's checks carry their place in the training step (shardcheck.harness.core.model_case): every module's
output in forward order, the loss, the gradient at every module's output in backward order.  For one item (op, case,
topology, dtype) the chart draws err/budget (the worst rank's) of each of them on a log scale, forward above and
backward below, then every parameter's gradient and stepped value, modules in execution order, the budget
(err/budget = 1) as a line and the first divergence (shardcheck.harness.findings.model_order) marked.  `profile` is
the chart's data, for tests and for people without the picture.
"""

from __future__ import annotations

import math
import re
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: CI and laptops without a display
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.font_manager import FontProperties  # noqa: E402
from matplotlib.ticker import FuncFormatter, NullLocator  # noqa: E402

from shardcheck.harness.core.compare import FAILING  # noqa: E402
from shardcheck.harness.core.model_case import CHECK  # noqa: E402
from shardcheck.harness.core.records import with_mesh_splits  # noqa: E402
from shardcheck.harness.core.topology import topology_name  # noqa: E402
from shardcheck.harness.findings import model_order  # noqa: E402
from shardcheck.reports import png  # noqa: E402
from shardcheck.reports.label_space import text_width  # noqa: E402

ITEM_KEY = ["op", "case_id", "dp", "cp", "tp", "dtype", "ep", "dp_replicate"]
FLOOR = 1e-6  # an exact match (err/budget 0) is drawn here
TITLES = {
    "forward": "forward: module outputs in execution order, then the loss",
    "backward": "backward: the gradient at each module's output, in backward order",
    "parameters": "parameters: each gradient, then each value after the optimizer step",
}
# failing items charted per report (the first ones, in run order): a chart costs most of a second of drawing, a run
# of a broken plan fails every item, and their charts tell the same story; each item's rerun line charts it alone
MAX_CHARTS = 3


def _ratio(row: dict) -> float:
    """err/budget of a row; a check without a ratio that failed (wrong shape, missing) is infinitely off."""
    r = row.get("err_ratio")
    if r is None or (isinstance(r, float) and math.isnan(r)):
        return math.inf if row.get("status") in FAILING else math.nan
    return float(r)


def profile(rows: pd.DataFrame) -> pd.DataFrame:
    """One item's model checks in step order: columns direction (forward / backward / parameters), order, module
    (a module path, "loss", or "<parameter> (gradient)" / "(after the step)"), check, status, err_ratio, first (the
    first divergence; the loss is the forward's last point)."""
    records = rows.to_dict("records")
    first = first_divergence(rows)
    out = []
    for r in records:
        m = CHECK.match(str(r["check"]))
        if m is None:
            continue
        kind = m.group(1) or m.group(4) or m.group(5)
        direction = "forward" if kind in ("act", "loss") else "backward" if kind == "dact" else "parameters"
        words = {"dparam": "gradient", "state": "optimizer state", "step": "after the step"}
        name = kind if m.group(4) else m.group(3) if m.group(1) else f"{m.group(6)} ({words[kind]})"
        name += "@" + str(r["check"]).split("@", 1)[1] if "@" in str(r["check"]) else ""
        out.append(
            {
                "direction": direction,
                "order": model_order.step_order(r["check"]),
                "module": name,
                "check": r["check"],
                "status": r["status"],
                "err_ratio": _ratio(r),
                "first": r["check"] == first,
            }
        )
    table = pd.DataFrame(out, columns=["direction", "order", "module", "check", "status", "err_ratio", "first"])
    return table.sort_values("order", kind="stable").reset_index(drop=True)


def first_divergence(rows: pd.DataFrame) -> str | None:
    """The first failing model check of the item (a module's, the loss, or a parameter's) as the findings line
    names it (model_order.summary: step order, then the case's output order), or None where none fails."""
    return model_order.first_check(list(rows.loc[rows["status"].isin(FAILING), "check"].map(str)))


# The chart's geometry, in inches: each panel's plot area, and the room around it (the panel's title above; the
# y label and its ticks left; a "first divergence" note at the last point right; the figure's title on top, a line at
# a time: title_lines); the module names below each panel take their width, and Agg draws text ~8 % wider than its
# outline's metrics.
PANEL_HEIGHT, TITLE_ROOM, LEFT, RIGHT, MARGIN, AGG_WIDER = 2.6, 0.35, 0.85, 0.9, 0.1, 1.1
SUPTITLE_LINE, SUPTITLE_PAD = 0.2, 0.15  # the figure's title: each line of it, and the room under it
_TICK_FONT, _SUPTITLE_FONT = FontProperties(size=6), FontProperties(size=9)


_SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


def _power_of_ten(value: float, _position) -> str:
    """A log axis's tick label as plain text (10⁻⁶): matplotlib's own is mathtext, parsed at every draw."""
    exponent = round(math.log10(value)) if value > 0 else 0
    return "1" if exponent == 0 else f"10{str(exponent).translate(_SUPERSCRIPT)}"


def figure_width(parts: list[pd.DataFrame]) -> float:
    """The chart's width in inches: more modules, wider (the width constrained layout was given)."""
    return max(8.0, 0.22 * sum(len(p) for p in parts) / 3 + 4)


def title_lines(text: str, width: float) -> list[str]:
    """The figure's title, each of its lines wrapped at spaces to fit a figure `width` inches wide (a findings line
    naming many parameters is longer than any chart is wide)."""
    room = (width - 2 * MARGIN) / AGG_WIDER
    lines = []
    for line in text.splitlines():
        per_char = text_width([line], _SUPTITLE_FONT) / max(len(line), 1)
        lines += textwrap.wrap(line, max(20, int(room / per_char)), break_long_words=False) or [""]
    return lines


def _figure(parts: list[pd.DataFrame], width: float, title_rows: int) -> tuple[plt.Figure, list[plt.Axes]]:
    """Three panels stacked under a title of `title_rows` lines, each as high as PANEL_HEIGHT plus the room of its
    module names (rotated 90°): the picture constrained layout gave, laid out from the labels' widths."""
    below = [AGG_WIDER * text_width(p["module"], _TICK_FONT) + 0.15 for p in parts]
    heading = SUPTITLE_PAD + SUPTITLE_LINE * title_rows
    height = heading + sum(TITLE_ROOM + PANEL_HEIGHT + b for b in below) + MARGIN
    fig = plt.figure(figsize=(width, height))
    axes, top = [], height - heading
    for b in below:
        top -= TITLE_ROOM + PANEL_HEIGHT
        box = (LEFT / width, top / height, (width - LEFT - RIGHT) / width, PANEL_HEIGHT / height)
        axes.append(fig.add_axes(box))
        top -= b
    return fig, axes


def draw(rows: pd.DataFrame, path: Path, title: str) -> pd.DataFrame:
    """The chart of one item's rows at `path`; returns its data (profile)."""
    data = profile(rows)
    first = first_divergence(rows)
    directions = ("forward", "backward", "parameters")
    parts = [data[data["direction"] == d].reset_index(drop=True) for d in directions]
    width = figure_width(parts)
    where = model_order.summary([first]) if first else "every check within its budget"
    heading = title_lines(f"{title}\n{where}", width)
    fig, axes = _figure(parts, width, len(heading))
    for ax, direction, part in zip(axes, directions, parts):
        y = part["err_ratio"].fillna(FLOOR).clip(lower=FLOOR)
        top = max(10.0, float(y[y != math.inf].max()) * 10 if (y != math.inf).any() else 10.0)
        y = y.where(y != math.inf, top)  # no ratio (wrong shape): at the top
        colours = ["#b00" if s in FAILING else "#2a2" for s in part["status"]]
        ax.plot(range(len(part)), y, color="#999", lw=0.8, zorder=1)
        ax.scatter(range(len(part)), y, c=colours, s=18, zorder=2)
        ax.axhline(1.0, color="#b00", ls="--", lw=0.8)
        ax.set_yscale("log")
        ax.yaxis.set_minor_locator(NullLocator())  # (the decades are the scale; minor ticks were ~a tenth of the draw)
        ax.yaxis.set_major_formatter(FuncFormatter(_power_of_ten))
        ax.set_ylabel("err / budget (worst rank)")
        ax.set_title(TITLES[direction], fontsize=9, y=1.0)  # placed, not worked out from the ticks: no layout pass
        ax.set_xticks(range(len(part)), part["module"], rotation=90, fontproperties=_TICK_FONT)  # as _figure measured
        ax.grid(alpha=0.3)
        for i in part.index[part["first"]]:
            ax.axvline(i, color="#b00", lw=1.5, alpha=0.6)
            ax.annotate(
                "first divergence", (i, y[i]), xytext=(5, 5), textcoords="offset points", color="#b00", fontsize=8
            )
    fig.suptitle("\n".join(heading), fontsize=9, y=1 - MARGIN / fig.get_size_inches()[1], va="top")
    png.save(fig, path, dpi=90)
    return data


def chart_name(key: tuple) -> str:
    op, case_id, dp, cp, tp, dtype, *splits = key  # (ep, dp_replicate: 1 where the key has none)
    name = f"model_{op.split('.')[-1]}_{case_id}_{topology_name(dp, cp, tp, *splits)}_{dtype}"
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name) + ".png"


def model_charts(df: pd.DataFrame, run_dir: Path) -> list[tuple[str, Path]]:
    """(title, png) for each failing model case item (the first MAX_CHARTS, in run order)."""
    is_model = df["check"].map(lambda c: model_order.step_order(c) is not None)
    model = with_mesh_splits(df[is_model])
    charts = []
    for key, rows in model.groupby(ITEM_KEY, sort=False):
        if not rows["status"].isin(FAILING).any():
            continue
        op, case_id, dp, cp, tp, dtype, ep, dp_replicate = key
        title = f"model {op} [{case_id}] {topology_name(dp, cp, tp, ep, dp_replicate)} {dtype}: err/budget by module"
        path = run_dir / chart_name(key)
        draw(rows, path, title)
        charts.append((title, path))
        if len(charts) == MAX_CHARTS:
            break
    return charts
