"""shardcheck.harness.core.processes: fresh ranks with torchrun's environment, events in one global order, logs,
exceptions, deaths, and a deadline that ends hangs.

The functions run in the ranks live at module level (the ranks import this module to find them).
"""

from __future__ import annotations

import logging
import os
import signal
import time

import torch
import torch.distributed as dist

from shardcheck.harness.core.processes import run_ranks

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR")


def _job(proc, scale: float) -> dict:
    """Environment, a process group created from it (as user code would), a collective, events."""
    env = {k: os.environ.get(k) for k in ENV_KEYS}
    proc.event("start", rank=proc.rank)
    dist.init_process_group("gloo")
    total = torch.tensor([float(proc.rank) * scale])
    dist.all_reduce(total)
    if proc.rank == 1:  # rank 1 goes on only once rank 0 reached "ready"
        proc.wait_for("ready", [0], timeout=30)
    else:
        time.sleep(0.2)
        proc.event("ready")
    proc.event("done")
    logging.getLogger("shardcheck.test").warning("rank %d done", proc.rank)
    dist.destroy_process_group()
    return {"env": env, "sum": total.item(), "node": proc.node, "local_rank": proc.local_rank}


def test_simulated_nodes_env_events_and_logs():
    run = run_ranks(_job, 4, nodes=2, args=(10.0,), deadline=60)
    assert not run.timed_out and [r.exitcode for r in run.ranks] == [0, 0, 0, 0], run.describe()
    for r in run.ranks:
        res = r.result
        assert res["env"] == {
            "RANK": str(r.rank),
            "WORLD_SIZE": "4",
            "LOCAL_RANK": str(r.rank % 2),
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": str(r.rank // 2),
            "MASTER_ADDR": "127.0.0.1",
        }
        assert (res["node"], res["local_rank"]) == (r.rank // 2, r.rank % 2) == (r.node, r.local_rank)
        assert res["sum"] == 60.0  # (0 + 1 + 2 + 3) * 10
        assert [e.name for e in r.events] == ["start", "done"] if r.rank == 1 else ["start", "ready", "done"]
        assert [rec.message for rec in r.logs if rec.logger == "shardcheck.test"] == [f"rank {r.rank} done"]
    # one global order: sequence numbers are unique, and rank 1 finished only after rank 0 was ready
    seqs = [e.seq for e in run.events()] + [rec.seq for rec in run.logs]
    assert len(seqs) == len(set(seqs))
    assert run.ranks[1].event("done").seq > run.ranks[0].event("ready").seq
    assert run.events("start")[0].data == {"rank": run.events("start")[0].rank}


def _fails(proc) -> None:
    proc.event("begin")
    if proc.rank == 1:
        raise ValueError("bad input on rank 1")
    if proc.rank == 2:
        os.kill(os.getpid(), signal.SIGSEGV)  # a crash: no Python exception to report
    return None


def test_exceptions_and_deaths_are_reported_per_rank():
    run = run_ranks(_fails, 3, deadline=60)
    ok, raised, crashed = run.ranks
    assert ok.exitcode == 0 and ok.returned and ok.error is None
    assert raised.exitcode == 1 and not raised.returned
    assert raised.error == "ValueError: bad input on rank 1" and "_fails" in raised.traceback
    assert crashed.exitcode == -signal.SIGSEGV and crashed.error == f"died with signal {int(signal.SIGSEGV)}"
    assert run.origin().rank == 1  # an error of its own comes before a bare death
    assert [r.event("begin") is not None for r in run.ranks] == [True, True, True]


def _hangs(proc) -> None:
    proc.event("waiting")
    if proc.rank == 0:
        time.sleep(600)


def test_a_hang_is_killed_at_the_deadline():
    started = time.monotonic()
    run = run_ranks(_hangs, 2, deadline=2.0)
    took = time.monotonic() - started
    hung, done = run.ranks
    assert hung.killed and hung.exitcode == -signal.SIGKILL and not hung.returned
    assert hung.event("waiting") is not None  # what it did before is kept
    assert "still running at the deadline, killed (last event: waiting)" in hung.describe()
    assert not done.killed and done.exitcode == 0
    assert run.timed_out and 2.0 <= run.wall_s < 10 and took < 30


def _environment(proc) -> dict:
    return {k: os.environ.get(k) for k in ENV_KEYS}


def test_without_distributed_env():
    # this process may itself run under torchrun: nothing of it reaches a plain rank
    run = run_ranks(_environment, 1, distributed_env=False, deadline=60, env={"SHARDCHECK_TEST": "1"})
    assert run.ranks[0].result == dict.fromkeys(ENV_KEYS)


def test_bad_layout_is_rejected():
    import pytest

    with pytest.raises(ValueError):
        run_ranks(_environment, 3, nodes=2)
