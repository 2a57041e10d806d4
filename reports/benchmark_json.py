"""Export bench rows in pytest-benchmark's JSON format (what `pytest --benchmark-json` writes),
so tools that read it (pytest-benchmark compare, dashboards) can use shardcheck's timings."""

from __future__ import annotations

import datetime as dt
import json
import platform
from pathlib import Path

import pandas as pd
import pytest_benchmark
from pytest_benchmark.stats import Stats

from shardcheck.harness.core.records import with_mesh_splits
from shardcheck.harness.core.topology import topology_label

BENCHMARK_JSON = "benchmark.json"


def _stats(times_ms: list[float]) -> dict:
    stats = Stats()
    for t in times_ms:
        stats.update(t / 1e3)  # pytest-benchmark speaks seconds
    return {**stats.as_dict(), "iterations": 1, "data": [t / 1e3 for t in times_ms]}


def write(run_dir: Path, df: pd.DataFrame, meta: dict) -> Path | None:
    if "times_ms" not in df:
        return None
    bench = with_mesh_splits(df[(df["check"] == "bench") & df["times_ms"].notna()])
    if bench.empty:
        return None
    benchmarks = []
    for _, r in bench.iterrows():
        param = f"{r['case_id']}-{topology_label(r)}-{r['dtype']}"  # "dp4-ep2-cp1-tp1" where ep > 1
        extra = {
            k: r[k]
            for k in (
                "peak_bytes",
                "peak_bytes_fwd",
                "time_fwd_ms",
                "time_bwd_ms",
                "comm_calls",
                "comm_bytes",
                "ref_time_ms",
                "ref_peak_bytes",
                "expected_peak_bytes",
                "world_size",
                "device",
                "backend",
            )
            if k in r and _present(r[k])
        }
        benchmarks.append(
            {
                "group": r["op"],
                "name": f"{r['op']}[{param}]",
                "fullname": f"shardcheck::{r['op']}[{param}]",
                "params": {
                    **(r["params"] or {}),
                    "dp": int(r["dp"]),
                    "cp": int(r["cp"]),
                    "tp": int(r["tp"]),
                    "ep": int(r["ep"]),
                    "dp_replicate": int(r["dp_replicate"]),
                    "dtype": r["dtype"],
                },
                "param": param,
                "extra_info": extra,
                "options": {
                    "disable_gc": False,
                    "timer": "perf_counter" if r["device"] == "cpu" else "cuda_event",
                    "min_rounds": int(r["iters"]),
                    "max_time": 0,
                    "min_time": 0,
                    "warmup": int(r["warmup"]),
                },
                "stats": _stats(list(r["times_ms"])),
            }
        )
    doc = {
        "machine_info": {
            "node": meta.get("host"),
            "processor": platform.processor(),
            "machine": platform.machine(),
            "python_implementation": platform.python_implementation(),
            "python_version": platform.python_version(),
            "system": platform.system(),
            "release": platform.release(),
            "device_name": meta.get("device_name"),
        },
        "commit_info": {"id": meta.get("git_commit"), "dirty": meta.get("git_dirty"), "project": "shardcheck"},
        "benchmarks": benchmarks,
        "datetime": meta.get("start") or dt.datetime.now().isoformat(),
        "version": pytest_benchmark.__version__,
    }
    path = run_dir / BENCHMARK_JSON
    path.write_text(json.dumps(doc, indent=1, default=str))
    return path


def _present(v) -> bool:
    return not (isinstance(v, float) and pd.isna(v))
