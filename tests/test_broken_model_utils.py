"""The harness must *fail* on wrong implementations of model_utils, naming the check and the rank.

Each module under tests/broken/model_utils/ has one deliberate bug; everything else is the
real implementation.  Runs are kept small (one topology, float64: the sharp check).
"""

from __future__ import annotations

import pytest

from conftest import BROKEN

TP2 = ("--topology", "dp=1,cp=1,tp=2", "--dtype", "float64", "--quick")


def _impl(name: str) -> tuple[str, str]:
    return ("--impl", f"model_utils={BROKEN / 'model_utils' / name}.py")


@pytest.mark.parametrize("module, op, check, ranks", [
    # offset bug lives on the ranks whose vocab does not start at 0: rank 1's gradient is wrong
    ("wrong_vocab_offset", "DistributedLogprob", "grad:logits", {1}),
    # local max: every rank's log-softmax is off
    ("missing_max_allreduce", "_compute_distributed_log_softmax", "forward", {0, 1}),
    # values right, gradients doubled on every TP rank
    ("grad_scaled_by_tp", "DistributedLogprob", "grad:logits", {0, 1}),
    # only TP rank 1 returns different values
    ("one_rank_off", "DistributedLogprob", "forward", {1}),
    # positions of the last partial chunk are never computed
    ("dropped_last_chunk", "ChunkedDistributedLogprob", "forward", {0, 1}),
])
def test_wrong_values_are_caught(run_shardcheck, module, op, check, ranks):
    run = run_shardcheck("run", *_impl(module), "--op", f"model_utils.{op}", *TP2)
    assert run.returncode == 1, run.stdout + run.stderr
    bad = run.failed()
    assert set(bad["op"]) == {f"model_utils.{op}"}
    rows = bad[bad["check"] == check]
    assert len(rows), f"{check} did not fail: {bad[['case_id', 'check', 'message']]}"
    assert (rows["status"] == "fail").all()
    # every failing row names a rank that really is wrong, with where and what
    for _, row in rows.iterrows():
        assert row["mismatch"]["rank"] in ranks
        assert row["mismatch"]["global_index"] is not None and row["mismatch"]["local_index"] is not None
        failing = {r["rank"] for r in row["per_rank"] if r["status"] == "fail"}
        assert failing <= ranks and failing
        assert f"rank {row['mismatch']['rank']} (dp=0, cp=0, tp={row['mismatch']['rank']})" in row["message"]
    # the failure is about sharding, not noise: far above the float64 budget
    assert (rows["err_ratio"].fillna(float("inf")) > 100).all()
    assert "FAIL" in run.stdout


@pytest.mark.parametrize("module, culprit, words", [
    ("skips_collective", 1, "did not finish the case within"),  # rank 0 blocks in the all-reduce rank 1 skipped
    ("error_one_rank", 1, "RuntimeError: shard check failed"),
    ("rank_dies", 1, "rank 1 died: exit code 13"),
])
def test_hangs_errors_and_deaths_become_error_rows(run_shardcheck, module, culprit, words):
    """Never hang: the case errors within --timeout, names the culprit rank, and the run goes on."""
    run = run_shardcheck("run", *_impl(module), "--op", "model_utils.DistributedLogprob",
                         "--op", "model_utils.ChunkedDistributedLogprob", "--case", "b2s5*", *TP2, "--timeout", "5",
                         timeout=300)  # a loaded 2-core machine: launches take 20-30 s each
    assert run.returncode == 1, run.stdout + run.stderr
    rows = run.rows
    bad = rows[rows["op"] == "model_utils.DistributedLogprob"]
    forward = bad[bad["check"] == "forward"].iloc[0]
    assert forward["status"] == "error"
    assert forward["mismatch"]["rank"] == culprit, forward["message"]
    assert forward["message"].startswith(f"rank {culprit} (dp=0, cp=0, tp={culprit})")
    assert words in forward["message"]
    # the remaining cases ran in a relaunch and pass
    chunked = rows[rows["op"] == "model_utils.ChunkedDistributedLogprob"]
    assert len(chunked) and (chunked["status"] == "pass").all()
