"""The worker started by a torchrun command written by hand (several nodes, SLURM, ...).

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint HOST:PORT -m shardcheck.harness.standalone \\
        --suite model_utils --out /nfs/shardcheck-runs/x

Every rank builds the same plan from the same arguments (no communication
needed; an external suite's `--suite-path` must then name a file every node sees); the world
runs every selected topology whose size divides it.  Rank 0 merges the
per-rank events into results.jsonl after each case, so --out must be on a filesystem that every
node sees; it completes run.json and writes the report at the end.  Rank 0 exits as `shardcheck
run` does: 1 when a check failed or errored (or warned, with --strict), else 0.

A hang ends the run at once (a hand-launched run cannot replace its ranks): every rank runs a watchdog thread; at
--timeout after an item's start (or when a rank's check-in after the item finds a peer missing) the rank that
notices claims the finding in torchrun's store (`_Hang`).  Rank 0 claims at once; another rank claims only when rank
0 has not within TAKEOVER seconds (rank 0 stuck in native code that holds the GIL: its Python threads do not run).
The claimant writes the finding (every rank's stack, dumped by faulthandler's C timer, and the collectives compared),
skips the items left, completes run.json, writes the report and exits 1; torchrun then ends the other ranks.  Where
no rank's Python runs at all (every rank holding the GIL in native code), only the stack files are written and the
run waits for torchrun or the user.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch.distributed as dist

from shardcheck.harness.core.events import EXIT_PEER_STUCK, stack_path
from shardcheck.harness.core.options import (
    EXIT_OK,
    EXIT_USAGE,
    RunSettings,
    UsageError,
    UsageParser,
    add_selection_args,
)
from shardcheck.harness.core.plan_data import Item, Plan
from shardcheck.harness.core.records import RESULTS, RUN_META, RecordWriter
from shardcheck.harness.core.topology import Topology, default_topologies, expert_topologies
from shardcheck.harness.driver import postmortem, stacks
from shardcheck.harness.driver.collect import Collector
from shardcheck.harness.driver.planner import DEFAULT_DTYPES
from shardcheck.harness.driver.pool import rank_log
from shardcheck.harness.driver.run import close_run, exit_code, open_run, plan_from_args
from shardcheck.harness.rank import flight_recorder
from shardcheck.harness.rank import worker as worker_module
from shardcheck.harness.rank.worker import Worker
from shardcheck.reports.sinks import Outputs, finish

TAKEOVER = 3.0  # seconds a rank other than 0 leaves rank 0 to claim a hang's finding before claiming it itself
WATCH_SLICE = 0.2  # how often the watchdog thread looks at the item in flight
WRITTEN_WAIT = 120.0  # seconds a rank that lost the claim waits for the finding before it exits anyway
ANSWER_WAIT = 2.0  # seconds the claimant of a death waits for the live ranks to answer torchrun's SIGTERM
# A rank whose process ended without answering: torchrun's summary has its exit code (it is not told to the ranks).
ENDED = "its process ended"


def main(argv: list[str] | None = None) -> int:
    try:
        args, settings, topologies = _options(argv)
    except UsageError as exc:
        print(f"shardcheck worker: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    # torchrun ends every rank with SIGTERM when one dies: blocked here, before any thread starts (threads inherit
    # the mask), it reaches _Hang's thread alone (sigwait), which writes the finding before this rank ends.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    sigterm = _Sigterm()
    sigterm.start()
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    try:
        plan = _plan(args, settings, topologies, world)
    except UsageError as exc:
        print(f"shardcheck worker: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    launch_dir = args.out / "workers"
    events_dir = launch_dir / "standalone"
    events_dir.mkdir(parents=True, exist_ok=True)
    _tee_stderr(rank_log(launch_dir, rank))
    (launch_dir / f"rank{rank}.host-pid").write_text(f"{socket.gethostname()} {os.getpid()}")
    worker = _worker(settings, launch_dir, rank)
    worker.load(plan, events_dir)
    hang = _Hang(worker, plan, _RunFolders(launch_dir, events_dir, args.out), args.strict)
    sigterm.hang = hang
    if rank != 0:
        hang.start()
        worker.run(on_stuck=hang.end)
        dist.barrier()
        dist.destroy_process_group()
        return EXIT_OK
    return _run_as_rank0(worker, plan, hang, args.out, args.strict)


def _options(argv: list[str] | None) -> tuple[argparse.Namespace, RunSettings, list[Topology]]:
    """The options, the run's settings made of them (the checks of `shardcheck run`) and the topologies asked for:
    UsageError when bad."""
    p = UsageParser(prog="python -m shardcheck.harness.standalone")
    add_selection_args(p)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    device = args.device or "cpu"
    settings = RunSettings.of_args(args, device, "nccl" if device == "cuda" else "gloo")
    return args, settings, [Topology.parse(t) for t in args.topology or []]


def _plan(args: argparse.Namespace, settings: RunSettings, topologies: list[Topology], world: int) -> Plan:
    """Every selected topology whose size divides this world (default: all of them), in one launch of it."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "standalone") + "-" + str(world)
    divisors = [w for w in range(1, world + 1) if world % w == 0]
    topologies = topologies or default_topologies(divisors) + expert_topologies(divisors)
    return plan_from_args(
        args,
        settings,
        run_id=run_id,
        world_sizes=[world],
        topologies=[t for t in topologies if world % t.size == 0],
        default_dtypes=list(DEFAULT_DTYPES),
    )


def _worker(settings: RunSettings, launch_dir: Path, rank: int) -> Worker:
    """This rank's worker, in torchrun's process group.  Where a hung case was, as the driver's ranks tell it: each
    rank dumps its own stack into the shared folder when an item outlives --timeout (no driver here to signal ranks on
    other nodes), and on SIGUSR1 (`kill -USR1` by hand); its collectives go to rank<R>.collectives.  Rank 0 folds
    them into the finding (`_stuck`)."""
    worker = Worker(settings.device, settings.backend, settings.shims)
    worker.dump_stacks_to = open(stack_path(launch_dir, rank), "a")
    faulthandler.register(signal.SIGUSR1, file=worker.dump_stacks_to, all_threads=True, chain=False)
    if flight_recorder.enabled():  # before the modules under test are imported (worker.load)
        worker.recorder = flight_recorder.install(launch_dir, rank)
    return worker


def _run_as_rank0(worker: Worker, plan: Plan, hang: _Hang, out: Path, strict: bool) -> int:
    """Rank 0's run: it merges every rank's events into results.jsonl after each case, then completes run.json and
    writes the report; the exit code."""
    writer, meta = open_run(out, plan, sys.argv)
    collector = Collector(plan, plan.items, hang.folders.events, writer, worker.world)
    hang.collector, hang.writer, hang.meta = collector, writer, meta
    hang.start()
    worker.run(on_item_done=lambda item: collector.poll(), on_stuck=hang.end)
    dist.barrier()  # every rank has written its last 'done'
    collector.poll()
    close_run(out, writer, meta)
    # settled (a line demoted to warn: its rows too, findings/verdicts.py), then its pages (reports/sinks.py)
    counts = finish(out, writer.counts, Outputs(plan.run_id)).counts
    dist.destroy_process_group()
    return exit_code(counts, strict)


@dataclass(frozen=True)
class _RunFolders:
    """Where a hand-launched run writes: the ranks' logs, stacks and collectives (`launch`), their events (`events`),
    and the run directory (`out`, --out)."""

    launch: Path
    events: Path
    out: Path


class _Hang:
    """Ends the run at a hang, on the one rank that claims it: the main thread's check-in after an item (a peer
    missing) or the watchdog thread (the item still in flight at --timeout: this rank blocked in a collective or
    spinning) calls `end`, which never returns.  Rank 0 writes with its own collector; another rank, when rank 0's
    Python does not run, reads the events and rows rank 0 left and appends after them."""

    def __init__(self, worker: Worker, plan: Plan, folders: _RunFolders, strict: bool):
        self.worker, self.plan, self.folders, self.strict = worker, plan, folders, strict
        self.launch_dir, self.events_dir, self.out = folders.launch, folders.events, folders.out
        self.rank = worker.rank
        # torchrun's store (its agent hosts it): it outlives any rank, and a blocked process group does not touch it
        self.store = dist.PrefixStore("shardcheck-hang", dist.distributed_c10d._get_default_store())
        self.collector: Collector | None = None  # rank 0's
        self.writer: RecordWriter | None = None
        self.meta: dict | None = None
        self.lock = threading.Lock()  # the main thread and the watchdog may both end the run: the first one does

    def start(self) -> None:
        threading.Thread(target=self._watch, name="shardcheck-hang-watchdog", daemon=True).start()

    def on_sigterm(self) -> NoReturn:
        """torchrun ends every rank when one died (or the run was interrupted, or the claimant of a hang exited):
        this rank answers in the store, then the case in flight is written as `end` writes a hang, the ranks that
        did not answer named dead, with their last error lines (their stderr, teed into rank<R>.log)."""
        try:
            self.store.set(f"answered/{self.rank}", "1")
        except Exception:
            pass
        current = self.worker.current
        if current is None:  # no case in flight (between cases, or after the run): nothing to tell
            _exit(128 + signal.SIGTERM)
        self.end(current[0], terminated=True)

    def _watch(self) -> None:
        # A Python thread: it runs while the main thread spins in Python or waits in gloo (which releases the GIL),
        # not while the main thread holds the GIL in native code (another rank takes over then: `end`).
        while True:
            current = self.worker.current
            late = current is not None and time.time() >= current[1] + self.plan.timeout
            if late and self.worker.current is current:  # (not the case that ended just now)
                self.end(current[0])
            time.sleep(WATCH_SLICE)

    def end(self, item: Item, terminated: bool = False) -> NoReturn:
        self.lock.acquire()  # (never released: this process ends here)
        if self.worker.recorder is not None:  # this rank's records written back, for a claimant on another node
            self.worker.recorder.flush()
        key = f"{self.worker.plans_loaded - 1}/{item.id}"
        if self.rank != 0:  # rank 0 claims first when its Python runs; the lowest other rank after it
            time.sleep(TAKEOVER + 0.2 * self.rank)
        try:
            mine = self.store.add(f"claim/{key}", 1) == 1
        except Exception:  # the store is gone: torchrun is ending the run
            mine = False
        if not mine:
            try:
                self.store.wait([f"written/{key}"], timedelta(seconds=WRITTEN_WAIT))
            except Exception:
                pass
            _exit(EXIT_PEER_STUCK)
        code = 1
        try:
            code = self._write(item, terminated)
            if self.rank != 0 and not terminated:  # rank 0 did not claim: it may hold the GIL (then no SIGTERM either)
                _kill_if_local(self.launch_dir, 0)
        except BaseException:  # the finding could not be written: say why, and still end the run
            traceback.print_exc()
        finally:
            try:
                self.store.set(f"written/{key}", str(self.rank))
            except Exception:
                pass
        _exit(code)

    def _dead(self, item: Item) -> dict[int, str]:
        """The case's ranks that did not answer torchrun's SIGTERM within ANSWER_WAIT: {rank: how it ended}."""
        dp, cp, tp = item.topology
        keys = {r: f"answered/{r}" for r in range(dp * cp * tp)}
        try:
            self.store.wait(list(keys.values()), timedelta(seconds=ANSWER_WAIT))
        except Exception:  # some did not answer
            pass
        return {r: ENDED for r, key in keys.items() if not self.store.check([key])}

    def _write(self, item: Item, terminated: bool) -> int:
        """The hung (or, `terminated` by torchrun, the dead) item's finding, the items left skipped, run.json
        completed and the report: the exit code."""
        collector, writer, meta = self.collector, self.writer, self.meta
        if collector is None:  # rank 0 cannot: after the rows it wrote, from the events every rank left
            writer = RecordWriter(self.out)
            meta = json.loads((self.out / RUN_META).read_text()) if (self.out / RUN_META).is_file() else {}
            collector = Collector(self.plan, self.plan.items, self.events_dir, writer, self.worker.world)
            written = {
                (r["op"], r["case_id"], r["dtype"], r["dp"], r["cp"], r["tp"], r.get("ep", 1)) for r in _rows(self.out)
            }
            collector.finished.update(
                i.id for i in self.plan.items if (i.op, i.case_id, i.dtype, *i.topology, i.ep) in written
            )
        if terminated:
            deaths = self._dead(item)
            # no rank dead: torchrun was interrupted (Ctrl-C, its own limits) while the case ran
            reason = "" if deaths else "interrupted: torchrun ended the ranks (SIGTERM) while the case ran"
            cause = _died(collector, item, self.launch_dir, self.out, deaths, reason)
        else:
            started = self.worker.current[1] if self.worker.current else time.time()
            late = (
                f"rank(s) did not finish the case within --timeout {self.plan.timeout:g}s; "
                if time.time() - started >= self.plan.timeout
                else ""
            )  # (else: a peer raised, the others wait)
            reason = f"{late}rank {self.rank} took the ranks' stacks and ended the hand-launched run"
            at_barrier = threading.current_thread() is threading.main_thread()  # (else: the watchdog's thread)
            cause = _stuck(collector, item, self.folders, reason, writer_rank=self.rank, at_barrier=at_barrier)
        reason = (
            f"not run: the run ended at {item.op} case {item.case_id} {item.dtype} at "
            f"{item.full_topology} "
            f"({cause}); a hand-launched run cannot replace its ranks"
        )
        for rest in collector.unfinished():
            collector.skip(rest, reason)
        writer.counts = dict(Counter(r["status"] for r in _rows(self.out)))  # rank 0's rows and these
        close_run(self.out, writer, meta)
        writer.counts = finish(self.out, writer.counts, Outputs(self.plan.run_id)).counts
        print(
            f"shardcheck worker (rank {self.rank}): the run ended at {item.op} {item.case_id} ({cause}): "
            f"{self.out / RESULTS}",
            file=sys.stderr,
        )
        return exit_code(writer.counts, self.strict)


class _Sigterm(threading.Thread):
    """Takes torchrun's SIGTERM (blocked in every other thread): before the run's cases start, the rank ends at once;
    after, `_Hang.on_sigterm` writes the case in flight first."""

    def __init__(self):
        super().__init__(name="shardcheck-sigterm", daemon=True)
        self.hang: _Hang | None = None

    def run(self) -> None:
        signal.sigwait({signal.SIGTERM})
        if self.hang is None:
            _exit(128 + signal.SIGTERM)
        self.hang.on_sigterm()


def _died(collector: Collector, item: Item, launch_dir: Path, out: Path, deaths: dict[int, str], reason: str) -> str:
    """The finding of a case that lost ranks: their last error lines and the collectives compared."""
    collector.poll()
    evidence = postmortem.of_dumps(launch_dir, item, 0, {}, deaths, out)
    return collector.abort(item, reason, deaths=deaths, evidence=evidence)


def _local_pids(launch_dir: Path, ranks: list[int]) -> dict[int, int]:
    """{rank: pid} of the ranks in `ranks` that run on this host (each wrote rank<R>.host-pid at its start)."""
    pids = {}
    for rank in ranks:
        try:
            host, pid = (launch_dir / f"rank{rank}.host-pid").read_text().split()
        except (OSError, ValueError):
            continue
        if host == socket.gethostname():
            pids[rank] = int(pid)
    return pids


def _kill_if_local(launch_dir: Path, rank: int) -> None:
    """SIGKILL `rank` when it runs on this host (torchrun would after its 30 s grace; on another host it still does)."""
    for pid in _local_pids(launch_dir, [rank]).values():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _tee_stderr(log: Path) -> None:
    """This rank's stderr also into `log`, as the driver's ranks have rank<R>.log: a dead rank's last error lines
    (a traceback, gloo's abort) for the finding.  A `tee` process copies it, in a session of its own (torchrun's
    teardown does not end it first): it reads to the end of the pipe however this rank ends (an abort, SIGKILL)."""
    tee = shutil.which("tee")
    if tee is None:  # (no coreutils: the finding then says only that the rank ended)
        return
    read, write = os.pipe()
    console = os.dup(2)
    subprocess.Popen(
        [tee, "-a", str(log)],
        stdin=read,
        stdout=console,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )
    os.close(read)
    os.close(console)
    os.dup2(write, 2)
    os.close(write)


def _rows(out: Path) -> list[dict]:
    path = out / RESULTS
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _exit(code: int) -> NoReturn:
    """End this process now: its main thread may be blocked in a collective that never returns."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _stuck(
    collector: Collector, item: Item, folders: _RunFolders, reason: str, *, writer_rank: int, at_barrier: bool
) -> str:
    """The hung item's finding: every rank's own stack dump (written at --timeout) and every rank's collectives,
    compared, as the driver's postmortem does.  Returns the cause in a few words."""
    launch_dir, out = folders.launch, folders.out
    collector.poll()
    started = min(collector.state[item.id].started.values(), default=0.0)
    dp, cp, tp = item.topology
    ranks = list(range(dp * cp * tp))
    # the ranks on this host dump their stacks now (SIGUSR1, answered by faulthandler's C handler); the others' own
    # timers dump theirs at --timeout (a peer that raised ends the case sooner: then only this host's are in)
    local = _local_pids(launch_dir, ranks)
    local.pop(writer_rank, None)  # (its own stack now is this code's: its timer's, or the barrier it came from)
    dumps = stacks.take(launch_dir, sorted(local), local)
    if at_barrier:  # the writer came from its check-in after the case: in the words of a stack, at the barrier
        dumps[writer_rank] = (
            f"Current thread 0x0000000000000000 (most recent call first):\n  File "
            f'"{worker_module.__file__}", line 0 in barrier\n  (rank {writer_rank} wrote the '
            "finding from its check-in after the case)\n"
        )
    remote = [r for r in ranks if r not in dumps]
    if remote:
        dumps |= stacks.dumped_since(launch_dir, remote, started, wait=stacks.STACK_WAIT + 3)
    evidence = postmortem.of_dumps(launch_dir, item, 0, dumps, {}, out)
    return collector.abort(item, reason, evidence=evidence)


if __name__ == "__main__":
    sys.exit(main())
