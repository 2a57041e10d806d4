"""The worker started by a torchrun command written by hand (several nodes, SLURM, ...).

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:PORT -m harness.worker \\
        --suite model_utils --out /nfs/shardcheck-runs/x

Every rank builds the same plan from the same arguments (no communication needed); the
world runs every selected topology whose size divides it.  Rank 0 merges the per-rank
events into results.jsonl after each case, so --out must be on a filesystem that every
node sees; it writes run.json and the report at the end.  Rank 0 exits as `shardcheck run`
does: 1 when a check failed or errored (or warned, with --strict), else 0.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
from pathlib import Path

import torch.distributed as dist

from harness import shims
from harness.cli import _impl_map, _str_list, add_selection_args
from harness.collect import Collector
from harness.plan import DEFAULT_DTYPES, build_plan
from harness.records import RecordWriter, run_metadata, write_json
from harness.signatures import signature_rows
from harness.topology import Topology, UsageError, default_topologies


def run_standalone(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.worker")
    add_selection_args(p)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    device = args.device or "cpu"
    backend = "nccl" if device == "cuda" else "gloo"
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "standalone") + "-" + str(world)
    try:
        divisors = [w for w in range(1, world + 1) if world % w == 0]
        topologies = [Topology.parse(t) for t in args.topology or []] or default_topologies(divisors)
        if not args.no_shims:  # before the module under test is imported
            shims.install(device)
        plan = build_plan(run_id=run_id, suites_wanted=_str_list(args.suite), ops=_str_list(args.op),
                          case_patterns=_str_list(args.case), world_sizes=[world],
                          topologies=[t for t in topologies if world % t.size == 0],
                          dtypes=_str_list(args.dtype) or list(DEFAULT_DTYPES), impl=_impl_map(args.impl),
                          quick=args.quick, seed=args.seed, timeout=args.timeout, device=device, backend=backend)
        plan.shims = not args.no_shims
    except UsageError as exc:
        print(f"shardcheck worker: error: {exc}", file=sys.stderr)
        return 2
    from harness.worker import Worker

    events_dir = args.out / "workers" / "standalone"
    worker = Worker(plan, events_dir)
    if rank != 0:
        worker.run()
        dist.barrier()
        dist.destroy_process_group()
        return 0
    writer = RecordWriter(args.out)
    meta = {**run_metadata(run_id, sys.argv, device, backend), **shims.describe(device, plan.shims),
            "start": dt.datetime.now().isoformat(timespec="seconds")}
    for row in signature_rows(plan, meta):  # as `shardcheck run`: one finding per op whose signature drifted
        writer.write(row)
    collector = Collector(plan, plan.items, events_dir, writer, world)
    worker.run(on_item_done=lambda item: collector.poll(),
               on_stuck=lambda item: (collector.poll(), collector.abort(item, "")))
    dist.barrier()  # every rank has written its last 'done'
    collector.poll()
    writer.close()
    write_json(args.out / "run.json", {**meta, "end": dt.datetime.now().isoformat(timespec="seconds"), "summary": writer.counts})
    from reports.report import build

    build(args.out)
    dist.destroy_process_group()
    counts = writer.counts
    return 1 if counts["fail"] or counts["error"] or (args.strict and counts["warn"]) else 0
