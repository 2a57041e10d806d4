"""The loose ends of --bench, --profile and the run header: a bench sweep naming no parameter is bad usage (one line,
exit 2), --profile merges the launch threads' profiles, the header says whether a shim was used or only installed,
and run.json's machine makes compare and dashboard judge only memory and collectives across machines."""

from __future__ import annotations

import json

import pandas as pd
from helpers import FIXTURES, cli

BAD_SWEEP = f"""
import dataclasses, sys
sys.path.insert(0, {str(FIXTURES / "memory")!r})
import dtensor_memory as base

FAMILY = base.FAMILY
IMPLEMENTATION = {str(FIXTURES / "memory" / "_dtensor_memory_ops.py")!r}


def cases(quick):
    return base.cases(quick)


def bench_cases(quick):
    return [dataclasses.replace(c, params={{"sweep": SWEEP}}) for c in base.bench_cases(quick)]
"""


def test_bench_sweep_naming_no_parameter_is_one_line_and_exit_2(tmp_path):
    for sweep, why in (('"S"', "which its params lack"), ('"sweep"', "not a number there")):
        suite = tmp_path / f"bad_sweep_{len(why)}.py"
        suite.write_text(BAD_SWEEP.replace("SWEEP", sweep))
        run = cli(
            "run",
            "--bench",
            "--suite-path",
            str(suite),
            "--topology",
            "tp=1",
            "--no-progress",
            "--out",
            str(tmp_path / f"run{len(why)}"),
        )
        assert run.returncode == 2, run.stdout + run.stderr
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
        assert "dtensor_memory.scale_exp [r64c256]: params['sweep']" in lines[0] and why in lines[0], lines[0]
        assert not (tmp_path / f"run{len(why)}").exists()  # a run that never began leaves nothing behind


# ---- the machine in run.json; compare and dashboard across machines ----------------------------------------------

BOX_A = {"cpu": "Intel(R) Xeon(R) Platinum 8480C", "cores": 2, "gpu": None, "torch": "2.13.0"}
BOX_B = {"cpu": "AMD EPYC 9654 96-Core Processor", "cores": 16, "gpu": None, "torch": "2.13.0"}


def _bench_row(time_ms: float, peak: int, status: str = "pass") -> dict:
    return {
        "run_id": "r",
        "op": "model_utils.DistributedLogprob",
        "family": "model_utils",
        "case_id": "bench-S-1024",
        "dp": 1,
        "cp": 1,
        "tp": 1,
        "dtype": "float32",
        "device": "cpu",
        "check": "bench",
        "status": status,
        "time_ms": time_ms,
        "time_ms_iqr": 0.2,
        "peak_bytes": peak,
        "times_ms": [time_ms - 0.1, time_ms, time_ms + 0.1],
    }


def _comm_row(status: str) -> dict:
    return {**_bench_row(0.0, 0), "check": "property:comm", "status": status, "time_ms": None, "peak_bytes": None}


def _fake_run(tmp_path, name: str, start: str, machine: dict | None, rows: list[dict]):
    import json

    d = tmp_path / name
    d.mkdir()
    (d / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    meta = {"run_id": name, "start": start, "git_commit": name * 8, "git_dirty": False, "device_name": "x86_64"}
    (d / "run.json").write_text(json.dumps({**meta, **({"machine": machine} if machine else {})}))
    return d


def test_run_json_records_the_machine():
    import os

    import torch

    from shardcheck.harness.core.records import run_metadata

    machine = run_metadata("r", ["shardcheck", "run"], "cpu", "gloo")["machine"]  # what open_run writes to run.json
    assert machine["cores"] == os.cpu_count() and machine["torch"] == torch.__version__ and machine["gpu"] is None
    assert isinstance(machine["cpu"], str) and machine["cpu"] and machine["cpu"] != "x86_64"  # the model, not the arch


def test_compare_across_machines_judges_memory_and_collectives_only(tmp_path):
    base = _fake_run(tmp_path, "a", "2026-11-01T10:00:00", BOX_A, [_bench_row(10.0, 1000), _comm_row("pass")])
    # NEW: 3x the time (another box), memory +50 %, the collectives beyond the contract
    slower = [_bench_row(30.0, 1500), _comm_row("warn")]
    same = _fake_run(tmp_path, "b", "2026-11-02T10:00:00", BOX_A, slower)
    other = _fake_run(tmp_path, "c", "2026-11-02T10:00:00", BOX_B, slower)

    on_same = cli("compare", str(base), str(same))
    assert on_same.returncode == 1 and "REGRESSION: time +200%" in on_same.stdout, on_same.stdout
    assert "different machines" not in on_same.stdout

    across = cli("compare", str(base), str(other))
    assert across.returncode == 1, across.stdout + across.stderr
    assert "timings come from different machines" in across.stdout and BOX_B["cpu"] in across.stdout
    assert "REGRESSION: time" not in across.stdout and "time +" not in across.stdout  # not judged at all
    assert "REGRESSION: memory +50%" in across.stdout and "REGRESSION: pass -> warn" in across.stdout
    assert "**2 regression(s)**" in across.stdout

    # a run from before the machine was recorded: timings judged as before, no note
    old = _fake_run(tmp_path, "d", "2026-11-02T10:00:00", None, slower)
    legacy = cli("compare", str(base), str(old))
    assert "REGRESSION: time +200%" in legacy.stdout and "different machines" not in legacy.stdout


def test_dashboard_across_machines_marks_memory_not_time(tmp_path):
    from shardcheck.reports.dashboard import build_dashboard, load_runs, regressions

    dirs = [
        _fake_run(tmp_path, "a", "2026-11-01T10:00:00", BOX_A, [_bench_row(10.0, 1000)]),
        _fake_run(tmp_path, "b", "2026-11-02T10:00:00", BOX_B, [_bench_row(30.0, 1000)]),  # other box: 3x
        _fake_run(tmp_path, "c", "2026-11-03T10:00:00", BOX_B, [_bench_row(31.0, 1600)]),  # memory +60 %
        _fake_run(tmp_path, "d", "2026-11-04T10:00:00", BOX_B, [_bench_row(62.0, 1600)]),
    ]  # same box: 2x
    runs, rows = load_runs(dirs)
    marks = regressions(rows, max_slowdown=10.0, max_memory_growth=5.0)
    assert [(m.run, m.note.split(" ")[0]) for m in marks.itertuples()] == [(2, "memory"), (3, "time")]
    path, _ = build_dashboard(dirs, tmp_path / "out")
    page = path.read_text()
    assert "These runs come from 2 machines" in page and BOX_A["cpu"] in page and BOX_B["cpu"] in page


def test_benchmark_json_names_and_params_carry_ep_and_dp_replicate(tmp_path):
    from shardcheck.reports import benchmark_json

    def row(**split):
        return {
            "op": "moe.MoE",
            "case_id": "b2s8",
            "check": "bench",
            "dp": 4,
            "cp": 1,
            "tp": 1,
            **split,
            "dtype": "float32",
            "params": {"b": 2},
            "device": "cpu",
            "iters": 3,
            "warmup": 1,
            "times_ms": [1.0, 2.0, 3.0],
        }

    df = pd.DataFrame([row(), row(ep=2), row(dp_replicate=2)])
    doc = json.loads(benchmark_json.write(tmp_path, df, {}).read_text())
    names = [b["name"] for b in doc["benchmarks"]]
    # three topologies, three distinct names (pytest-benchmark compare keys by name)
    assert names == [
        "moe.MoE[b2s8-dp4-cp1-tp1-float32]",
        "moe.MoE[b2s8-dp4-ep2-cp1-tp1-float32]",
        "moe.MoE[b2s8-dp4r2-cp1-tp1-float32]",
    ]
    assert [(b["params"]["ep"], b["params"]["dp_replicate"]) for b in doc["benchmarks"]] == [(1, 1), (2, 1), (1, 2)]


def test_a_sweep_over_a_mesh_dim_keeps_ep_and_dp_replicate_apart():
    from shardcheck.reports.report import sweep_lines

    rows = pd.DataFrame(
        [
            {"op": "moe.MoE", "dp": 4, "cp": 1, "tp": 1, "dtype": "float32"},
            {"op": "moe.MoE", "dp": 4, "cp": 1, "tp": 1, "ep": 2, "dtype": "float32"},
            {"op": "moe.MoE", "dp": 4, "cp": 1, "tp": 1, "dp_replicate": 2, "dtype": "float32"},
        ]
    )
    assert list(sweep_lines(rows, "dp")) == ["MoE float32", "MoE ep2 float32", "MoE r2 float32"]
    assert list(sweep_lines(rows, "S")) == [
        "MoE dp4-cp1-tp1 float32",
        "MoE dp4-ep2-cp1-tp1 float32",
        "MoE dp4r2-cp1-tp1 float32",
    ]
