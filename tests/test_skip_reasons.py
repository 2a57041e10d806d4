"""Why a run skipped what it skipped: one counted line per reason in the CLI summary and report.md; the heatmap
tells planned-and-skipped from never planned."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd

from shardcheck.harness.cli import main
from shardcheck.reports import report


def test_the_summary_and_report_md_give_each_skip_reason_counted(tmp_path, capsys):
    # Only planned skips (16 positions cannot be split evenly over CP 3): no rank starts.
    code = main(
        [
            "run",
            "--suite",
            "model_utils_cp",
            "--case",
            "cp-shard1-*",
            "--topology",
            "dp=1,cp=3,tp=1",
            "--dtype",
            "float64",
            "--quick",
            "--no-progress",
            "--out",
            str(tmp_path / "runs"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    reason = (
        "input 'logits' [4, 16, 24] cannot be laid out at dp1-cp3-tp1: dim 1 of length 16 sharded over cp=3 splits "
        "into unequal pieces, and the case does not test unequal pieces over cp"
    )
    assert f"  3 checks (1 items) skipped: {reason}\n" in out, out
    md = (tmp_path / "runs" / "report.md").read_text()
    assert f"## Skipped\n\n- 3 checks (1 items) skipped: {reason}\n" in md, md


def _row(op: str, dp: int, status: str, message: str | None = None, dtype: str = "float64") -> dict:
    return {
        "op": op,
        "case_id": "c",
        "dp": dp,
        "cp": 1,
        "tp": 1,
        "dtype": dtype,
        "check": "forward",
        "status": status,
        "message": message,
        "err_ratio": 0.1 if status == "pass" else None,
    }


def test_skip_reason_lines_count_checks_and_items_most_first_and_cut_at_the_limit():
    rows = pd.DataFrame(
        [_row("f.a", 1, "pass")]
        + [_row("f.a", 2, "skip", "no extra", dtype=d) for d in ("float64", "float32")]
        + [_row("f.b", 2, "skip", "no extra")]
        + [_row("f.b", 4, "skip", "misfit")]
    )
    assert report.skip_reason_lines(rows) == [
        "3 checks (3 items) skipped: no extra",
        "1 checks (1 items) skipped: misfit",
    ]
    assert report.skip_reason_lines(rows, limit=1) == [
        "3 checks (3 items) skipped: no extra",
        "... 1 checks skipped for 1 other reasons (see report.md)",
    ]
    assert report.skip_reason_lines(rows[rows["status"] == "pass"]) == []


def test_the_heatmap_whitens_what_was_never_planned_and_says_so(tmp_path, monkeypatch):
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to look at
    # f.a planned at dp1 (passes) and dp2 (skipped); f.b planned at dp2 only: its dp1 cell was never planned
    rows = pd.DataFrame([_row("f.a", 1, "pass"), _row("f.a", 2, "skip", "misfit"), _row("f.b", 2, "pass")])
    report.heatmap(rows, tmp_path / "h.png")
    (ax,) = [a for a in figures[0].axes if a.get_title()]
    assert "white: not planned" in ax.get_title() and "grey: planned, not judged" in ax.get_title()
    white = ax.images[1].get_array()
    assert white.mask.tolist() == [[True, True], [False, True]]  # only f.b at dp1-cp1-tp1 is white
    assert [t.get_text() for t in ax.texts] == ["0.1", "skip", "", "0.1"]
