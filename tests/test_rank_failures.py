"""Ranks that hang, raise alone or die (tests/fixtures/model_utils/): the case errors within --timeout, names
the culprit rank, and the run goes on.  Runs are kept small (one topology, float64)."""

from __future__ import annotations

import pytest

from helpers import FIXTURES

TP2 = ("--topology", "dp=1,cp=1,tp=2", "--dtype", "float64", "--quick")


def _impl(name: str) -> tuple[str, str]:
    return ("--impl", f"model_utils={FIXTURES / 'model_utils' / name}.py")


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
