"""The report's per-module chart of a model case (reports/model_chart.py): a broken plan's run draws, next to
report.md and inside report.html, its modules in execution order against err/budget, forward and backward, and the
point it marks is the findings line's first diverging module (asserted on the chart's data, not its pixels)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from helpers import BROKEN, ROOT

from shardcheck.reports.label_space import text_width
from shardcheck.reports.model_chart import (
    _SUPTITLE_FONT,
    AGG_WIDER,
    MARGIN,
    MAX_CHARTS,
    chart_name,
    figure_width,
    first_divergence,
    model_charts,
    profile,
    title_lines,
)

DECODER = ROOT / "examples" / "decoder_tp"


def _rows(checks: dict[str, tuple[str, float | None]]) -> pd.DataFrame:
    return pd.DataFrame([{"check": c, "status": s, "err_ratio": r} for c, (s, r) in checks.items()])


def test_the_profile_orders_the_step_and_marks_its_first_divergence():
    rows = _rows(
        {
            "forward:dact00:model": ("fail", 9.0),
            "forward:loss": ("fail", 40.0),
            "forward:act02:b": ("fail", 3e4),
            "forward:act00:a": ("pass", 0.0),
            "forward:act01:b.inner": ("fail", 2.5),
            "forward:dparam:b.weight": ("fail", 7.0),
            "forward:step:b.weight": ("fail", None),
            "forward:dact01:b": ("pass", 0.3),
            "grad:x": ("fail", 5.0),
        }
    )
    data = profile(rows)
    assert list(data["check"]) == [
        "forward:act00:a",
        "forward:act01:b.inner",
        "forward:act02:b",
        "forward:loss",
        "forward:dact00:model",
        "forward:dact01:b",
        "forward:dparam:b.weight",
        "forward:step:b.weight",
    ]  # step order; a check that is not the model's is left out
    assert list(data["direction"]) == ["forward"] * 4 + ["backward"] * 2 + ["parameters"] * 2
    assert data.loc[data["first"], "module"].tolist() == ["b.inner"]  # the first failing, not the worst
    assert math.isinf(data["err_ratio"].iloc[-1])  # a failure without a ratio (wrong shape) is drawn at the top
    passing = _rows({"forward:act00:a": ("pass", 0.1), "forward:loss": ("pass", 0.2)})
    assert first_divergence(passing) is None and not profile(passing)["first"].any()
    # the first of equals in step order (parameters share theirs) is the case's first, as the findings line says
    assert (
        first_divergence(_rows({"forward:dparam:n.weight": ("fail", 2.0), "forward:dparam:m.weight": ("fail", 9.0)}))
        == "forward:dparam:n.weight"
    )
    assert (
        chart_name(("f.parallelize", "a/b c", 1, 1, 2, "float64")) == "model_parallelize_a_b_c_dp1-cp1-tp2_float64.png"
    )


def test_a_broken_plan_draws_its_chart_marking_the_first_diverging_module(shared_run):
    run = shared_run(  # the run test_model_case.py's rowwise_output_partial asserts on
        "run",
        "--suite-path",
        str(DECODER),
        "--suite",
        "decoder_tp",
        "--case",
        "mha",
        "--world-sizes",
        "1,2",
        "--dtype",
        "float64",
        "--impl",
        f"decoder_tp={BROKEN / 'decoder_tp' / 'rowwise_output_partial'}.py",
    )
    assert run.returncode == 1
    png = run.out / "model_parallelize_mha_dp1-cp1-tp2_float64.png"
    assert png.is_file() and png.stat().st_size > 10_000
    assert f"]({png.name})" in (run.out / "report.md").read_text()
    assert "err/budget by module" in (run.out / "report.html").read_text()
    assert not list(run.out.glob("model_*tp1*.png"))  # a passing item gets no chart
    rows = run.rows[run.rows["tp"] == 2]
    data = profile(rows)
    marked = data[data["first"]]
    assert marked[["direction", "module"]].values.tolist() == [["forward", "layers.0.attention.wo"]]
    assert marked["check"].iloc[0] in run.causes.iloc[0].checks  # the findings line's first divergence
    forward = data[data["direction"] == "forward"].reset_index(drop=True)
    at = forward.index[forward["first"]][0]
    assert (forward["err_ratio"][:at] <= 1).all() and (forward["err_ratio"][at:] > 1).all()
    assert len(data[data["direction"] == "backward"]) and len(data[data["direction"] == "parameters"])


def test_only_the_first_few_failing_items_are_charted(tmp_path):
    """A broken plan fails every item; charts cost seconds each, so the report draws the first MAX_CHARTS."""
    rng = np.random.default_rng(0)
    rows = [
        {
            "op": "decoder_tp.parallelize",
            "case_id": "mha",
            "dp": 1,
            "cp": 1,
            "tp": tp,
            "dtype": dtype,
            "check": check,
            "status": "fail" if check != "forward:act00:a" else "pass",
            "err_ratio": float(rng.uniform(0.1, 9.0)),
        }
        for dtype in ("float64", "float32", "bfloat16")
        for tp in (2, 4)
        for check in ("forward:act00:a", "forward:act01:b", "forward:loss", "forward:dact00:b")
    ]
    charts = model_charts(pd.DataFrame(rows), tmp_path)
    assert [path.name for _, path in charts] == [
        "model_parallelize_mha_dp1-cp1-tp2_float64.png",
        "model_parallelize_mha_dp1-cp1-tp4_float64.png",
        "model_parallelize_mha_dp1-cp1-tp2_float32.png",
    ]
    assert len(list(tmp_path.glob("*.png"))) == MAX_CHARTS == 3


def test_a_long_findings_line_is_wrapped_to_the_charts_width():
    """A findings line naming many parameters was wider than the chart, its ends cut off."""
    params = ", ".join(f"layers.{i}.attention_norm.weight" for i in range(12))
    where = f"first diverging: parameter layers.0.attention_norm.weight (gradient); wrong parameters: {params}"
    title = "model decoder_tp.parallelize [mha] dp1-cp1-tp2 float64: err/budget by module"
    width = figure_width([pd.DataFrame({"m": range(3)})] * 3)  # a small model: the narrowest chart
    lines = title_lines(f"{title}\n{where}", width)
    assert lines[0] == title and len(lines) >= 3
    assert " ".join(lines[1:]).split() == where.split()  # every word kept, in order
    assert max(text_width([line], _SUPTITLE_FONT) for line in lines) * AGG_WIDER <= width - 2 * MARGIN
