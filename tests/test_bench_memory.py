"""Per-rank peak memory on CPU counts the storages a rank allocates: a DTensor's local pieces, never the global shape
of DTensor's wrapper (tests/fixtures/memory: an elementwise op on a sharded DTensor, and a replicated gather)."""

from __future__ import annotations

from helpers import FIXTURES, shardcheck

TOPOLOGIES = [arg for t in ("tp=1", "tp=2", "tp=4") for arg in ("--topology", t)]
FULL_BYTES = 64 * 256 * 4  # the fixture's [64, 256] float32 input


def test_dtensor_peak_is_local_storage(tmp_path):
    run = shardcheck("run", "--bench", "--bench-iters", "2", "--suite-path", str(FIXTURES / "memory"), *TOPOLOGIES,
                     out=tmp_path / "run")
    assert run.returncode == 0, run.stdout + run.stderr
    rows = run.rows
    peak = rows[rows["check"] == "bench"].set_index(["op", "tp"])["peak_bytes"]
    # exp(2x): two local pieces alive at once (2x, then its exp) on every rank: 1/TP of the TP 1 figure
    scale = peak.loc["dtensor_memory.scale_exp"]
    assert scale[1] == 2 * FULL_BYTES, scale
    assert scale[2] == scale[1] / 2 and scale[4] == scale[1] / 4, scale
    # the gather holds the full tensor on every rank (all-gather output, then its contiguous copy): never falls
    gather = peak.loc["dtensor_memory.gather"]
    assert gather[2] == gather[4] == 2 * FULL_BYTES, gather
