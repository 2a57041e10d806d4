"""`shardcheck dashboard`: many runs on one page, ordered by start, regressions marked by compare's rule,
devices and dtypes never mixed in a line."""

from __future__ import annotations

import json

import pandas as pd
from helpers import cli

from shardcheck.reports.dashboard import LINE_KEY, _line_name, build_dashboard, load_runs, regressions, status_counts


def _bench(time_ms, peak=1000, iqr=0.2, dtype="float32", device="cpu", case_id="bench-S-1024", status="pass"):
    return {
        "run_id": "r",
        "op": "model_utils.DistributedLogprob",
        "family": "model_utils",
        "case_id": case_id,
        "dp": 1,
        "cp": 1,
        "tp": 1,
        "dtype": dtype,
        "device": device,
        "check": "bench",
        "status": status,
        "time_ms": time_ms,
        "time_ms_iqr": iqr,
        "peak_bytes": peak,
        "times_ms": [time_ms - iqr / 2, time_ms, time_ms + iqr / 2],
    }


def _check(status, case_id="b4s6"):
    return {
        "run_id": "r",
        "op": "model_utils.DistributedLogprob",
        "family": "model_utils",
        "case_id": case_id,
        "dp": 1,
        "cp": 1,
        "tp": 2,
        "dtype": "float64",
        "device": "cpu",
        "check": "forward",
        "status": status,
    }


def _run(tmp_path, name, start, commit, rows, device_name="x86_64"):
    d = tmp_path / name
    d.mkdir()
    (d / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "run.json").write_text(
        json.dumps(
            {"run_id": name, "start": start, "git_commit": commit, "git_dirty": False, "device_name": device_name}
        )
    )
    return d


def _history(tmp_path):
    return [  # given out of order: the dashboard orders by start time
        _run(
            tmp_path,
            "c",
            "2026-11-03T10:00:00",
            "cccccccc1",
            [_bench(10.2, peak=1500), _check("fail"), _bench(99.0, dtype="bfloat16")],
        ),
        _run(
            tmp_path,
            "a",
            "2026-11-01T10:00:00",
            "aaaaaaaa1",
            [_bench(10.0), _check("pass"), _bench(5.0, dtype="bfloat16")],
        ),
        _run(tmp_path, "b", "2026-11-02T10:00:00", "bbbbbbbb1", [_bench(21.0), _check("pass")]),
        # another device: 10x slower, but never compared with the CPU line
        _run(tmp_path, "d", "2026-11-04T10:00:00", "dddddddd1", [_bench(100.0)], device_name="slow-box"),
    ]


def test_runs_are_ordered_and_regressions_follow_compares_rule(tmp_path):
    runs, rows = load_runs(_history(tmp_path))
    assert list(runs["run_id"]) == ["a", "b", "c", "d"]
    assert runs["label"][0].startswith("aaaaaaaa\n")
    marks = regressions(rows, max_slowdown=10.0, max_memory_growth=5.0)
    found = {(m.run, m.dtype, m.device_name, m.note.split(" ")[0]) for m in marks.itertuples()}
    # a -> b: time doubled (beyond 10% and the spread); b -> c: memory +50% (time came back down);
    # bfloat16 a -> c: 5 -> 99 ms is a regression of its own line; run d is on another device: no mark
    assert found == {
        (1, "float32", "x86_64", "time"),
        (2, "float32", "x86_64", "memory"),
        (2, "bfloat16", "x86_64", "time"),
    }
    table = status_counts(runs, rows)
    assert list(table["pass"]) == [3, 2, 2, 1] and list(table["fail"]) == [0, 0, 1, 0]
    assert list(table["new failures"]) == [0, 0, 1, 0]


def test_dashboard_command_writes_a_self_contained_page(tmp_path):
    dirs = _history(tmp_path)
    proc = cli("dashboard", *map(str, dirs), "--out", str(tmp_path / "dash"))
    assert proc.returncode == 0, proc.stderr
    assert "4 runs, 3 regression mark(s)" in proc.stdout
    page = (tmp_path / "dash" / "dashboard.html").read_text()
    assert page.count("data:image/png;base64,") == 2  # pass/fail counts + the one op x case figure
    assert "src='http" not in page and "<script" not in page  # self-contained
    assert "<h2>Regressions (3)</h2>" in page and "time +110%" in page and "memory +50%" in page
    assert "cccccccc" in page and "slow-box" in page


def test_dashboard_of_a_missing_run_is_a_usage_error(tmp_path):
    proc = cli("dashboard", str(tmp_path / "nope"))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "no results.jsonl" in proc.stderr


def test_dashboard_reads_what_load_reads(tmp_path):
    dirs = _history(tmp_path)
    path, marks = build_dashboard(dirs, tmp_path / "out")
    assert path.is_file() and marks == 3
    _, rows = load_runs(dirs)
    assert len(rows) == sum(len(pd.read_json(d / "results.jsonl", lines=True)) for d in dirs)


def test_a_run_that_stopped_running_checks_or_fails_new_ones_counts_them(tmp_path):
    helper = "model_utils._helper"
    checks = [{**_check("pass", case_id=f"c{i}"), "op": helper} for i in range(4)]
    signature = {**_check("fail", case_id="signature"), "op": helper, "dp": 0, "dtype": "-"}
    dirs = [
        _run(tmp_path, "a", "2026-11-01T10:00:00", "aaaaaaaa1", checks + [_check("pass")]),
        # the helper's signature drifted: none of its cases ran; a check new in this run errors
        _run(tmp_path, "b", "2026-11-02T10:00:00", "bbbbbbbb1", [signature, _check("pass"), _check("error", "new")]),
        # another selection: only the other op, at another world size; nothing of the helper selected
        _run(tmp_path, "c", "2026-11-03T10:00:00", "cccccccc1", [{**_check("pass"), "tp": 4}]),
    ]
    runs, rows = load_runs(dirs)
    table = status_counts(runs, rows)
    assert list(table["new failures"]) == [0, 2, 0]
    assert list(table["not run"]) == [0, 4, 0]


def test_topologies_differing_only_in_ep_or_dp_replicate_are_separate_lines(tmp_path):
    def at(time_ms, **split):
        return {**_bench(time_ms), "dp": 4, **split}

    # per run: plain dp4 at 40 ms, dp4-ep2 at 10 ms, dp4r2 at 20 ms; one line of the three would see 10 -> 40 as a
    # regression within the run and between runs
    rows = [at(40.0), at(10.0, ep=2), at(20.0, dp_replicate=2)]
    dirs = [
        _run(tmp_path, "a", "2026-11-01T10:00:00", "aaaaaaaa1", rows),
        _run(tmp_path, "b", "2026-11-02T10:00:00", "bbbbbbbb1", rows),
    ]
    runs, loaded = load_runs(dirs)
    assert len(regressions(loaded, max_slowdown=10.0, max_memory_growth=5.0)) == 0
    lines = sorted(_line_name(key) for key, _ in loaded.groupby(LINE_KEY))
    assert lines == [
        "dp4-cp1-tp1 float32 cpu (x86_64)",
        "dp4-ep2-cp1-tp1 float32 cpu (x86_64)",
        "dp4r2-cp1-tp1 float32 cpu (x86_64)",
    ]
