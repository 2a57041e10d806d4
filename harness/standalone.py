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
import faulthandler
import os
import signal
import sys
from pathlib import Path

import torch.distributed as dist

from shardcheck.harness.core.events import stack_path
from shardcheck.harness.core.plan_data import Item
from shardcheck.harness.driver import postmortem, stacks
from shardcheck.harness.driver.collect import Collector
from shardcheck.harness.driver.planner import DEFAULT_DTYPES
from shardcheck.harness.driver.run import EXIT_OK, EXIT_USAGE, add_selection_args, close_run, exit_code, open_run, plan_from_args
from shardcheck.harness.core.topology import Topology, UsageError, default_topologies
from shardcheck.harness.rank import flight_recorder
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
    launch_dir = args.out / "workers"
    events_dir = launch_dir / "standalone"
    events_dir.mkdir(parents=True, exist_ok=True)
    worker = Worker(device, backend, plan.timeout, plan.shims)
    # Where a hung case was, as the driver's ranks tell it: each rank dumps its own stack into the shared folder when
    # an item outlives --timeout (no driver here to signal ranks on other nodes), and on SIGUSR1 (`kill -USR1` by
    # hand); its collectives go to rank<R>.collectives*.jsonl.  Rank 0 folds them into the finding (`_stuck`).
    worker.dump_stacks_to = open(stack_path(launch_dir, rank), "a")
    faulthandler.register(signal.SIGUSR1, file=worker.dump_stacks_to, all_threads=True, chain=False)
    if flight_recorder.enabled():  # before the modules under test are imported (worker.load)
        worker.recorder = flight_recorder.install(launch_dir, rank)
    worker.load(plan, events_dir)
    if rank != 0:
        worker.run()
        dist.barrier()
        dist.destroy_process_group()
        return EXIT_OK
    writer, meta = open_run(args.out, plan, sys.argv)
    collector = Collector(plan, plan.items, events_dir, writer, world)
    worker.run(on_item_done=lambda item: collector.poll(),
               on_stuck=lambda item: _stuck(collector, item, launch_dir, args.out))
    dist.barrier()  # every rank has written its last 'done'
    collector.poll()
    close_run(args.out, writer, meta)
    build(args.out)
    dist.destroy_process_group()
    return exit_code(writer.counts, args.strict)


def _stuck(collector: Collector, item: Item, launch_dir: Path, out: Path) -> None:
    """Rank 0 found peers missing at the item's barrier: their own stack dumps (written at --timeout) and every
    rank's collectives, compared, make the finding, as the driver's postmortem does."""
    collector.poll()
    started = min(collector.state[item.id].started.values(), default=0.0)
    dp, cp, tp = item.topology
    dumps = stacks.dumped_since(launch_dir, list(range(dp * cp * tp)), started, wait=stacks.STACK_WAIT + 3)
    evidence = postmortem.of_dumps(launch_dir, item, 0, dumps, {}, out)
    collector.abort(item, "", evidence=evidence)


if __name__ == "__main__":
    sys.exit(main())
