"""The worker started by a torchrun command written by hand (several nodes, SLURM, ...).

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:PORT -m shardcheck.harness.standalone \\
        --suite model_utils --out /nfs/shardcheck-runs/x

Every rank builds the same plan from the same arguments (no communication
needed; an external suite's `--suite-path` must then name a file every node sees); the world
runs every selected topology whose size divides it.  Rank 0 merges the
per-rank events into results.jsonl after each case, so --out must be on a filesystem that every
node sees; it completes run.json and writes the report at the end.  Rank 0 exits as `shardcheck
run` does: 1 when a check failed or errored (or warned, with --strict), else 0.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch.distributed as dist

from shardcheck.harness.driver.collect import Collector
from shardcheck.harness.driver.planner import DEFAULT_DTYPES
from shardcheck.harness.driver.run import EXIT_OK, EXIT_USAGE, add_selection_args, close_run, exit_code, open_run, plan_from_args
from shardcheck.harness.core.topology import Topology, UsageError, default_topologies
from shardcheck.harness.rank.worker import Worker
from shardcheck.reports.report import build


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shardcheck.harness.standalone")
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
        plan = plan_from_args(args, run_id=run_id, world_sizes=[world],
                              topologies=[t for t in topologies if world % t.size == 0], device=device,
                              backend=backend, default_dtypes=list(DEFAULT_DTYPES))
    except UsageError as exc:
        print(f"shardcheck worker: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    events_dir = args.out / "workers" / "standalone"
    worker = Worker(device, backend, plan.timeout, plan.shims)
    worker.load(plan, events_dir)
    if rank != 0:
        worker.run()
        dist.barrier()
        dist.destroy_process_group()
        return EXIT_OK
    writer, meta = open_run(args.out, plan, sys.argv)
    collector = Collector(plan, plan.items, events_dir, writer, world)
    worker.run(on_item_done=lambda item: collector.poll(),
               on_stuck=lambda item: (collector.poll(), collector.abort(item, "")))
    dist.barrier()  # every rank has written its last 'done'
    collector.poll()
    close_run(args.out, writer, meta)
    build(args.out)
    dist.destroy_process_group()
    return exit_code(writer.counts, args.strict)


if __name__ == "__main__":
    sys.exit(main())
