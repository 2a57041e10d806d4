"""`shardcheck compare`: the regression gate on records (exit 0 / 1 / 2, Markdown table)."""

from __future__ import annotations

import json

import pytest
from helpers import cli


def _row(op="model_utils.DistributedLogprob", check="bench", status="pass", time_ms=10.0, iqr=0.5, peak=1000, **kw):
    return {
        "run_id": "r",
        "op": op,
        "family": "model_utils",
        "case_id": "S1024",
        "dp": 1,
        "cp": 1,
        "tp": 2,
        "dtype": "float32",
        "device": "cpu",
        "check": check,
        "status": status,
        "time_ms": time_ms,
        "time_ms_iqr": iqr,
        "peak_bytes": peak,
        **kw,
    }


def _run(tmp_path, name, rows):
    d = tmp_path / name
    d.mkdir()
    (d / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(d)


def test_same_run_passes(tmp_path):
    base = _run(tmp_path, "base", [_row(), _row(check="forward", time_ms=None, iqr=None, peak=None)])
    proc = cli("compare", base, base)
    assert proc.returncode == 0, proc.stdout
    assert "0 regression(s)" in proc.stdout


def test_two_fold_slowdown_is_a_regression(tmp_path):
    base = _run(tmp_path, "base", [_row(time_ms=10.0, iqr=0.5)])
    new = _run(tmp_path, "new", [_row(time_ms=20.0, iqr=0.8)])
    proc = cli("compare", base, new, "--max-slowdown", "50")
    assert proc.returncode == 1
    assert "REGRESSION: time +100% (10 -> 20 ms" in proc.stdout
    assert proc.stdout.splitlines()[2].startswith("| op ")  # a Markdown table CI can post


def test_slowdown_within_the_spread_is_noise(tmp_path):
    base = _run(tmp_path, "base", [_row(time_ms=10.0, iqr=15.0)])
    new = _run(tmp_path, "new", [_row(time_ms=20.0, iqr=12.0)])
    proc = cli("compare", base, new, "--max-slowdown", "50")
    assert proc.returncode == 0, proc.stdout
    assert "within spread" in proc.stdout


def test_memory_growth_and_new_failures(tmp_path):
    base = _run(tmp_path, "base", [_row(peak=1000), _row(check="grad:logits", time_ms=None, iqr=None, peak=None)])
    new = _run(
        tmp_path, "new", [_row(peak=1100), _row(check="grad:logits", status="fail", time_ms=None, iqr=None, peak=None)]
    )
    proc = cli("compare", base, new, "--max-memory-growth", "5")
    assert proc.returncode == 1
    assert "REGRESSION: memory +10%" in proc.stdout and "REGRESSION: pass -> fail" in proc.stdout
    assert "2 regression(s)" in proc.stdout


@pytest.mark.parametrize("which", ["base", "new"])
def test_missing_directory_is_usage_error(tmp_path, which):
    real = _run(tmp_path, "real", [_row()])
    args = [str(tmp_path / "nope"), real] if which == "base" else [real, str(tmp_path / "nope")]
    proc = cli("compare", *args)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "no results.jsonl" in proc.stderr


def test_unreadable_records_are_usage_error(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "results.jsonl").write_text("{not json\n")
    proc = cli("compare", str(bad), str(bad))
    assert proc.returncode == 2 and "cannot read runs" in proc.stderr


# ---- a failing NEW: a check that stopped running, a new failing check, runs of different selections -----------


def _check(op="kd_loss.KDLoss", case_id="b2s8", tp=2, dtype="float64", check="forward", status="pass"):
    return _row(op=op, case_id=case_id, tp=tp, dtype=dtype, check=check, status=status, time_ms=None, peak=None)


def _signature_failure(op):
    """The row of an op whose signature drifted: found before any case ran, it belongs to no topology."""
    return {**_check(op=op, case_id="signature", dtype="-", check="property:signature", status="fail"), "dp": 0}
    # cp and tp stay 1 here: dp 0 makes the world size 0, as the run's own row (dp0-cp0-tp0) does


def test_a_signature_failure_is_a_new_failure_and_its_unrun_checks_regressions(tmp_path):
    helper = "kd_loss._infer_tp_group_from_dtensor"
    checks = [_check(op=helper, tp=tp, check=c) for tp in (1, 2) for c in ("forward", "grad:logits", "property:a")]
    others = [_check(tp=1), _check(tp=2)]  # the suite's other op, run at both world sizes
    base = _run(tmp_path, "base", checks + others)
    new = _run(tmp_path, "new", [_signature_failure(helper), *others])
    proc = cli("compare", base, new)
    assert proc.returncode == 1, proc.stdout
    assert "**6 regression(s)**, **1 new failure(s)**" in proc.stdout
    assert f"- {helper}: 6 check(s) of BASE not run in NEW (passed in BASE)" in proc.stdout
    assert "NEW FAILURE: fail" in proc.stdout and "nan" not in proc.stdout
    assert proc.stdout.count("not run in NEW") == 1  # one line per op, not per row


def test_a_new_check_that_fails_fails_the_gate(tmp_path):
    base = _run(tmp_path, "base", [_check()])
    new = _run(tmp_path, "new", [_check(), _check(check="grad:logits", status="error")])
    proc = cli("compare", base, new)
    assert proc.returncode == 1 and "**0 regression(s)**, **1 new failure(s)**" in proc.stdout


def test_runs_of_different_selections_compare_on_what_both_ran(tmp_path):
    shared = [_check(tp=1, case_id=f"c{i}") for i in range(3)]
    only_new = [_check(tp=4, case_id=f"c{i}", check=f"grad:{k}") for i in range(3) for k in range(40)]
    only_base = [_check(op="model_utils.DistributedLogprob", tp=1)]
    base = _run(tmp_path, "base", shared + only_base)
    new = _run(tmp_path, "new", shared + only_new)
    proc = cli("compare", base, new)
    assert proc.returncode == 0, proc.stdout
    assert "No changes beyond the thresholds." in proc.stdout and "nan" not in proc.stdout
    assert (
        "runs of different selections, compared on what both ran: only BASE ran 1 check(s) "
        "(op(s) model_utils.DistributedLogprob); only NEW ran 120 check(s) (world size(s) 4)"
    ) in proc.stdout
    assert len(proc.stdout.splitlines()) < 10  # not a table row per added check
    back = cli("compare", new, base)  # the other way round: NEW's narrower selection is no regression either
    assert back.returncode == 0 and "only BASE ran 120 check(s) (world size(s) 4)" in back.stdout
