"""`shardcheck run` end to end: launch, every op forward and gradients, records, report."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT, shardcheck

from shardcheck.harness.core.records import load

CLASSIC_OPS = (
    "_compute_distributed_log_softmax",
    "_compute_distributed_softmax",
    "DistributedLogprob",
    "ChunkedDistributedLogprob",
    "DistributedCrossEntropy",
    "from_parallel_logits_to_logprobs",
    "all_to_all_vp2sq",
    "all_to_all_sq2vp",
)


@pytest.fixture(scope="module")
def quick_matrix(tmp_path_factory):
    """The quick matrix (world sizes 1, 2, 4) of model_utils' first eight ops, run once for this module (the
    other ops' quick matrices: test_model_utils, test_model_utils_cp, test_model_utils_megatron)."""
    ops = [arg for name in CLASSIC_OPS for arg in ("--op", f"model_utils.{name}")]
    return shardcheck(
        "run",
        "--suite",
        "model_utils",
        *ops,
        "--quick",
        "--world-sizes",
        "1,2,4",
        out=tmp_path_factory.mktemp("e2e") / "quick",
        fresh=True,
    )  # as a user runs it, launches and all


def test_quick_matrix_passes_with_records_and_report(quick_matrix):
    run = quick_matrix
    assert run.returncode == 0, run.stdout + run.stderr
    rows = run.rows
    assert (rows["status"] == "pass").all()
    # every (dp, 1, tp) default topology, every default dtype
    assert set(zip(rows["dp"], rows["tp"])) == {(1, 1), (2, 1), (1, 2), (4, 1), (2, 2), (1, 4)}
    assert set(rows["dtype"]) == {"float64", "float32", "bfloat16"}
    assert set(rows["op"]) == {f"model_utils.{name}" for name in CLASSIC_OPS}
    # differentiable ops have their gradient checks, on every rank of the topology
    for op, grad in (
        ("DistributedLogprob", "grad:logits"),
        ("ChunkedDistributedLogprob", "grad:logits"),
        ("from_parallel_logits_to_logprobs", "grad:logits"),
        ("DistributedCrossEntropy", "grad:student_logits"),
    ):
        g = rows[(rows["op"] == f"model_utils.{op}") & (rows["check"] == grad)]
        assert set(g["tp"]) == {1, 2, 4} and set(g["dtype"]) == {"float64", "float32", "bfloat16"}
    for _, row in rows.iterrows():
        if row["check"].startswith(("forward", "grad")):
            assert sorted(r["rank"] for r in row["per_rank"]) == list(range(row["dp"] * row["cp"] * row["tp"]))
    # float64 is the sharp check: sharded == golden far inside 1e-10 relative
    f64 = rows[(rows["dtype"] == "float64") & rows["err_ratio"].notna()]
    assert (f64["err_ratio"] < 1e-2).all()
    lowp = rows[(rows["dtype"] != "float64") & rows["err_ratio"].notna()]
    # per-row budgets: a row whose golden and reference are exactly 0 gets budget 0 (exact zeros required)
    assert (lowp["budget"] >= 0).all() and (lowp["budget"] > 0).any() and (lowp["err_ratio"] <= 1).all()
    required = {
        "run_id",
        "op",
        "family",
        "impl",
        "suite",
        "case_id",
        "params",
        "dp",
        "cp",
        "tp",
        "world_size",
        "dtype",
        "device",
        "backend",
        "check",
        "status",
        "max_abs_err",
        "max_rel_err",
        "budget",
        "err_ratio",
        "mismatch",
        "message",
    }
    assert required <= set(rows.columns)
    meta = json.loads((run.out / "run.json").read_text())
    assert meta["summary"]["pass"] == len(rows) and meta["backend"] == "gloo" and meta["end"]
    for name in ("report.md", "report.html", "agreement_heatmap.png"):
        assert (run.out / name).stat().st_size > 0
    html = (run.out / "report.html").read_text()
    assert "data:image/png;base64," in html and "model_utils.DistributedLogprob" in html
    assert "model_utils.ChunkedDistributedLogprob" in (run.out / "report.md").read_text()
    # one launch per world size, side by side; each topology in the launch of its own size (no spare rank waits)
    assert sorted(p.name for p in (run.out / "workers").iterdir()) == ["w1-launch0", "w2-launch0", "w4-launch0"]
    assert (rows["world_size"] == rows["dp"] * rows["cp"] * rows["tp"]).all()


def test_report_rebuilds_from_records_and_load_reads_many_runs(quick_matrix, run_shardcheck):
    a = quick_matrix
    b = run_shardcheck("run", "--op", "model_utils.all_to_all_sq2vp", "--quick", "--topology", "tp=2")
    assert b.returncode == 0
    (a.out / "report.md").unlink()
    proc = subprocess.run(
        [sys.executable, "-m", "shardcheck.harness.cli", "report", str(a.out)], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0 and "report.md" in proc.stdout and (a.out / "report.md").exists()
    both = load(a.out, b.out)
    assert len(both) == len(a.rows) + len(b.rows) and both["run_id"].nunique() == 2
    assert len(load(b.out.parent)) == len(b.rows)  # a directory of runs


def test_worker_runs_under_a_hand_written_torchrun(tmp_path):
    out = tmp_path / "by-hand"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "shardcheck.harness.standalone",
            "--op",
            "model_utils.DistributedLogprob",
            "--quick",
            "--dtype",
            "float64",
            "--strict",
            "--out",
            str(out),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = load(out)
    # world 2 runs every topology dividing it: tp1 and dp2 and tp2
    assert set(zip(rows["dp"], rows["tp"])) == {(1, 1), (2, 1), (1, 2)}
    assert (rows["status"] == "pass").all() and {"forward", "grad:logits"} <= set(rows["check"])
    assert (out / "report.html").exists() and (out / "run.json").exists()
