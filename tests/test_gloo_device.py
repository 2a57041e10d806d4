"""harness/rank/gloo_device.py: a rank's gloo process groups share one device, so one event-loop thread, and compute
what they computed on devices of their own."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from helpers import shared_pool

from shardcheck.harness.core.processes import run_ranks
from shardcheck.harness.rank import gloo_device

LOOP = "gloo_tcp_loop"  # the name gloo gives its device's event-loop thread
GROUP_THREADS = "pt_gloo_runloop"  # torch's worker threads, two per gloo group


def _thread_names(pid: int | str = "self") -> list[str]:
    tasks = f"/proc/{pid}/task"
    return [open(f"{tasks}/{tid}/comm").read().strip() for tid in os.listdir(tasks)]


def _groups_and_threads(proc, share: bool) -> dict:
    """Five groups beside the world's (two of them a subset), a seeded all_reduce and all_gather on each: the sums,
    the gathered pieces and the rank's threads."""
    if not share:
        os.environ[gloo_device.SWITCH] = "0"
    gloo_device.install()
    dist.init_process_group("gloo")
    groups = [dist.new_group() for _ in range(3)] + [dist.new_group([0, 2]) for _ in range(2)]
    values = torch.randn(4, generator=torch.Generator().manual_seed(100 + proc.rank), dtype=torch.float64)
    sums, gathered = [], []
    for group in groups:
        if proc.rank not in dist.get_process_group_ranks(group):
            continue
        total = values.clone()
        dist.all_reduce(total, group=group)
        pieces = [torch.empty_like(values) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, values, group=group)
        sums.append(total.tolist())
        gathered.append([p.tolist() for p in pieces])
    dist.barrier()
    return {"sums": sums, "gathered": gathered, "threads": _thread_names()}


def _expected(ranks: list[int]) -> tuple[list[float], list[list[float]]]:
    pieces = [torch.randn(4, generator=torch.Generator().manual_seed(100 + r), dtype=torch.float64) for r in ranks]
    return torch.stack(pieces).sum(0).tolist(), [p.tolist() for p in pieces]


def test_the_groups_of_a_rank_share_one_event_loop_and_compute_the_same():
    shared = run_ranks(_groups_and_threads, 3, args=(True,), deadline=60)
    apart = run_ranks(_groups_and_threads, 3, args=(False,), deadline=60)
    for run in (shared, apart):
        assert [r.exitcode for r in run.ranks] == [0, 0, 0], run.describe()
    world_sum, world_pieces = _expected([0, 1, 2])
    pair_sum, pair_pieces = _expected([0, 2])
    for rank, (a, b) in enumerate(zip(shared.ranks, apart.ranks)):
        members = 5 if rank in (0, 2) else 3
        assert len(a.result["sums"]) == members
        for i, (total, pieces) in enumerate(zip(a.result["sums"], a.result["gathered"])):
            want_sum, want_pieces = (world_sum, world_pieces) if i < 3 else (pair_sum, pair_pieces)
            assert torch.allclose(torch.tensor(total, dtype=torch.float64), torch.tensor(want_sum, dtype=torch.float64))
            assert pieces == want_pieces
        assert a.result["sums"] == b.result["sums"] and a.result["gathered"] == b.result["gathered"]
        # the world's group and each the rank is in have torch's two worker threads either way...
        assert a.result["threads"].count(GROUP_THREADS) == b.result["threads"].count(GROUP_THREADS) == 2 * (1 + members)
        # ...but one event loop where they share the device, one per group where they do not
        assert a.result["threads"].count(LOOP) == 1
        assert b.result["threads"].count(LOOP) == 1 + members


def test_a_pooled_launchs_ranks_each_run_one_gloo_event_loop(run_shardcheck):
    """The driver's ranks install it: after a run of several topologies at world size 4, the launch the pool keeps
    has many gloo groups on each rank and one event loop."""
    run = run_shardcheck(
        "run", "--op", "model_utils.DistributedLogprob", "--quick", "--dtype", "float64", "--world-sizes", "4"
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert len(set(zip(run.rows["dp"], run.rows["cp"], run.rows["tp"]))) >= 3
    launches = [launch for (world_size, _), launch in shared_pool().idle.items() if world_size == 4]
    assert launches, "the run's launch was not kept"
    for rank, pid in launches[-1].pids().items():
        names = _thread_names(pid)
        assert names.count(GROUP_THREADS) >= 2 * 6, (rank, names)  # the world's, and a group per mesh dimension
        assert names.count(LOOP) == 1, (rank, names)
