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
