"""The report's status table and agreement heatmap: their cells, worked out by built-in groupby aggregations, are
what a Python function per cell gives, and the heatmap's explicit margins keep every label inside the picture."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from shardcheck.harness.core.compare import STATUS_ORDER
from shardcheck.harness.core.records import Status
from shardcheck.reports import report


def _rows(seed: int, n: int = 400) -> pd.DataFrame:
    """Seeded rows over a few ops, dtypes and meshes: every status, err_ratio missing on some, and op × topology
    cells that no row reaches (never planned) or only skips reach."""
    rng = np.random.default_rng(seed)
    statuses = [str(s) for s in Status]
    rows = pd.DataFrame(
        {
            "op": rng.choice(["f.a", "f.b", "g.a_rather_long_function_name_of_a_module"], n),
            "case_id": "c",
            "dp": rng.choice([1, 2], n),
            "cp": 1,
            "tp": rng.choice([1, 2, 4], n),
            "dtype": rng.choice(["float64", "float32"], n),
            "check": "forward",
            "status": rng.choice(statuses, n, p=[0.55, 0.15, 0.05, 0.1, 0.05, 0.05, 0.05]),
            "err_ratio": np.where(rng.random(n) < 0.2, np.nan, 10 ** rng.uniform(-6, 1, n)),
        }
    )
    never_planned = (rows["op"] == "f.b") & (rows["tp"] == 4)
    only_skips = (rows["op"] == "f.a") & (rows["dp"] == 2) & (rows["tp"] == 2)
    rows = rows[~never_planned]
    return rows.assign(status=rows["status"].where(~only_skips, Status.SKIP))


def _worst(statuses: pd.Series) -> str:
    return max(statuses, key=STATUS_ORDER.__getitem__)


def _ran_worst(statuses: pd.Series) -> str:
    ran = statuses[statuses != Status.SKIP]
    return _worst(ran) if len(ran) else Status.SKIP


def test_the_status_table_and_heatmap_cells_are_the_worst_per_cell_as_a_python_function_gives():
    for seed in range(5):
        rows = _rows(seed)
        by_cell = rows.assign(topology=report._topology(rows))
        expected = by_cell.pivot_table(
            index=["op", "dtype"], columns="topology", values="status", aggfunc=_worst, fill_value=""
        )
        expected.columns.name = None
        table = report.status_table(rows)
        pd.testing.assert_frame_equal(table, expected.reset_index(), check_dtype=False)

        status = rows["status"]
        ratio = rows["err_ratio"].fillna(0.0).where(status == Status.PASS, np.nan)
        ratio = ratio.where(~status.isin([Status.XPASS, Status.FAIL, Status.ERROR]), np.inf)
        ratio = ratio.where(status != Status.WARN, rows["err_ratio"].fillna(np.inf))
        by_cell = by_cell.assign(ratio=ratio)
        grid_expected = by_cell.pivot_table(index="op", columns="topology", values="ratio", aggfunc="max", dropna=False)
        labels_expected = by_cell.pivot_table(
            index="op", columns="topology", values="status", aggfunc=_ran_worst, fill_value=""
        ).reindex(index=grid_expected.index, columns=grid_expected.columns, fill_value="")
        grid, labels = report.heatmap_cells(rows)
        np.testing.assert_array_equal(grid.to_numpy(float), grid_expected.to_numpy(float))
        assert labels.to_numpy().tolist() == labels_expected.to_numpy().tolist()
        assert (list(grid.index), list(grid.columns)) == (list(grid_expected.index), list(grid_expected.columns))
        # the cases the rows were built to hold: a never-planned cell ("") and a cell of skips only
        assert labels.loc["f.b", "dp1-cp1-tp4"] == "" and labels.loc["f.a", "dp2-cp1-tp2"] == Status.SKIP


def test_every_label_of_the_heatmap_lies_inside_its_picture(tmp_path, monkeypatch):
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to measure
    rows = _rows(0)
    long_topology = rows.assign(dp=16, cp=8, tp=16, ep=2)  # a wide slanted topology label under the first column
    report.heatmap(pd.concat([rows, long_topology]), tmp_path / "h.png")
    (fig,) = figures
    renderer = fig.canvas.get_renderer()
    box = fig.bbox
    ax, bar = fig.axes
    low, high = bar.get_ylim()
    drawn_ticks = [t for t, y in zip(bar.get_yticklabels(), bar.get_yticks()) if low <= y <= high]
    texts = [ax.title, *ax.get_xticklabels(), *ax.get_yticklabels(), bar.yaxis.label, *drawn_ticks]
    assert len(texts) == 1 + 7 + 3 + 1 + len(drawn_ticks) and len(drawn_ticks) >= 3  # 7 topologies, 3 ops
    for text in texts:
        extent = text.get_window_extent(renderer)
        inside = box.x0 <= extent.x0 and extent.x1 <= box.x1 and box.y0 <= extent.y0 and extent.y1 <= box.y1
        assert inside, (
            text.get_text(),
            extent,
            box,
        )
    plt.close(fig)
