"""Driver: one torchrun launch per world size, workers kept up for all its items.

A launch that ends early (a peer stuck past --timeout, a rank that crashed or was killed)
turns the item in flight into error rows naming the ranks, and the remaining items get a new
launch.  Hang budget: the op's other items at that topology are recorded `skip` ("hung in
case ..."), so a hanging op costs one timeout per topology, not one per item
(`hang_budget=False`, `--no-hang-budget`, tries every item).  A watchdog kills a launch that
reports nothing for --timeout + WATCHDOG_GRACE seconds, so no run ever hangs, whatever the
backend does.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import groupby
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from harness.artefacts import ArtefactBudget
from harness.collect import Collector
from harness.events import EXIT_PEER_STUCK
from harness.items import Item, Plan
from harness.records import RecordWriter

WATCHDOG_GRACE = 60.0  # start-up of a launch (imports, rendezvous) counts against the watchdog too
POLL_SECONDS = 0.05
# A relaunch starts (imports, rendezvous) while an item that may be hanging waits out its timeout, so
# the start-up does not add to the timeout: a standby launch is started once an item has run a quarter of
# the timeout (at least 2 s, at most 10 s: a start-up takes a few seconds, and a standby never needed costs
# a torch import per rank), and waits up to STANDBY_WAIT seconds for its plan.
STANDBY_WAIT = 900.0


def _standby_after(plan: Plan) -> float:
    return min(10.0, max(2.0, plan.timeout / 4))


def _worker_env() -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # ranks share the cores; one thread each avoids thrashing
    env["PYTHONUNBUFFERED"] = "1"
    # The source tree must be importable by the workers whether or not it is installed.
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def dead_ranks(log_text: str) -> dict[int, str]:
    """Ranks whose process died by itself ({rank: 'SIGKILL' | 'exit code 13'}), from torchrun's log.

    The failure summary gives each failed rank's exit code and pid ('rank : 1 (local_rank: 1)
    exitcode : -9 (pid: 123)'); torchrun logs every process it tears down ('Sending process 123
    closing signal SIGTERM').  A rank killed by a signal torchrun did not send is a culprit (an
    external kill -9, the OOM killer, a segfault); the teardown's victims and our own exit after a
    stuck peer are not."""
    torn_down = set(re.findall(r"Sending process (\d+) closing signal", log_text))
    found = re.findall(r"rank\s*:\s*(\d+) \(local_rank.*?exitcode\s*:\s*(-?\d+) \(pid: (\d+)\)", log_text, flags=re.S)
    deaths = {}
    for rank, code, pid in found:
        code = int(code)
        if code in (0, EXIT_PEER_STUCK) or pid in torn_down:
            continue
        deaths[int(rank)] = _signal_name(-code) if code < 0 else f"exit code {code}"
    return deaths


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _error_lines(log_text: str) -> str:
    lines = [ln for ln in log_text.splitlines() if re.search(r"Error|error:|Exception|Killed", ln)]
    return lines[-1].strip()[:300] if lines else ""


def run_plan(plan: Plan, run_dir: Path, writer: RecordWriter, show_progress: bool, hang_budget: bool = True,
             artefacts: ArtefactBudget | None = None) -> None:
    """Run every item of `plan`, one launch per world size (more after a hang or death); rows go to `writer`."""
    artefacts = artefacts if artefacts is not None else ArtefactBudget()
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        transient=False, disable=not show_progress)
    stop = threading.Event()  # set when the run ends early (an interrupt, or a launch thread failing)
    with progress:
        task = progress.add_task("checks", total=len(plan.items))
        worlds = [(w, list(items)) for w, items in
                  groupby(sorted(plan.items, key=lambda i: (i.world_size, i.id)), key=lambda i: i.world_size)]
        # On CPU the launches of different world sizes run side by side: a launch leaves cores idle while its
        # ranks wait on each other (collectives, the item barrier), and the others fill them.  Not when
        # benchmarking (a neighbour would skew the times), nor on GPUs (launches would share devices).
        if plan.device != "cpu" or plan.bench or len(worlds) == 1:
            for world_size, items in worlds:
                _run_world(plan, items, world_size, run_dir, writer, progress, task, hang_budget, artefacts, stop)
            return
        with ThreadPoolExecutor(max_workers=len(worlds), thread_name_prefix="shardcheck-launch") as pool:
            futures = [pool.submit(_run_world, plan, items, world_size, run_dir, writer, progress, task, hang_budget,
                                   artefacts, stop) for world_size, items in worlds]
            try:
                for future in futures:
                    future.result()
            except BaseException:
                stop.set()  # the other launch threads kill their workers and return
                raise


class _Launch:
    """One torchrun of `world_size` workers writing to `launch_dir`; its workers wait for plan.json,
    so it can be started (imports, rendezvous) before its plan is known."""

    def __init__(self, launch_dir: Path, world_size: int):
        launch_dir.mkdir(parents=True, exist_ok=True)
        self.dir = launch_dir
        self.log_path = launch_dir / "torchrun.log"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
               "--max-restarts=0", "-m", "harness.worker", "--plan", str(launch_dir / "plan.json"),
               "--plan-wait", f"{STANDBY_WAIT:g}", "--events", str(launch_dir)]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_worker_env(),
                                         start_new_session=True)

    def give_plan(self, plan: Plan) -> float:
        """Write the plan (atomically: workers poll for it); returns when."""
        tmp = self.dir / "plan.json.tmp"
        tmp.write_text(plan.to_json())
        os.replace(tmp, self.dir / "plan.json")
        return time.time()

    def discard(self) -> None:
        _kill(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)


def _running_for(collector: Collector) -> float:
    """Seconds the item in flight has been running (0 when none is)."""
    item = collector.in_flight()
    return time.time() - min(collector.state[item.id].started.values()) if item else 0.0


def _run_world(plan: Plan, items: list[Item], world_size: int, run_dir: Path, writer: RecordWriter,
               progress: Progress, task, hang_budget: bool, artefacts: ArtefactBudget, stop: threading.Event) -> None:
    standby: list[_Launch] = []  # at most one launch started ahead for the next attempt
    try:
        _run_launches(plan, items, world_size, run_dir, writer, progress, task, hang_budget, artefacts, standby, stop)
    except _Stopped:
        pass  # another launch thread ended the run; its exception is the one raised
    finally:
        for launch in standby:  # started ahead but never needed
            launch.discard()


class _Stopped(Exception):
    """The run is ending early: a launch thread stops its workers."""


def _run_launches(plan: Plan, items: list[Item], world_size: int, run_dir: Path, writer: RecordWriter,
                  progress: Progress, task, hang_budget: bool, artefacts: ArtefactBudget, standby: list[_Launch],
                  stop: threading.Event) -> None:
    """Launch after launch until every item of this world size has a row; `standby` holds the launch
    started ahead for the next attempt, if any."""
    remaining = items
    attempt = 0
    while remaining:
        launch_dir = run_dir / "workers" / f"w{world_size}-launch{attempt}"
        launch = standby.pop() if standby else None
        if launch is not None and launch.proc.poll() is not None:  # the standby failed by itself: start afresh
            launch.discard()
            launch = None
        launch = launch or _Launch(launch_dir, world_size)
        proc, log_path = launch.proc, launch.log_path
        collector = Collector(plan, remaining, launch.dir, writer, world_size, artefacts)
        started = launch.give_plan(Plan(**{**plan.__dict__, "items": remaining, "failure_artefacts": artefacts.left}))
        watchdog_reason = ""
        try:
            while proc.poll() is None:
                if stop.is_set():
                    raise _Stopped
                for item in collector.poll():
                    progress.update(task, advance=1, description=f"{item.op.split('.', 1)[1]} {item.dtype} "
                                                                 f"dp{item.topology[0]}cp{item.topology[1]}tp{item.topology[2]}")
                if collector.all_finished():  # every rank reported every item: torchrun's teardown adds nothing
                    if plan.profile:  # ... but the ranks write their profiles as they exit
                        try:
                            proc.wait(timeout=60)
                        except subprocess.TimeoutExpired:
                            pass
                    _kill(proc)
                    break
                quiet = time.time() - max(collector.last_event, started)
                if quiet > plan.timeout + WATCHDOG_GRACE:
                    watchdog_reason = f"no progress for {quiet:.0f}s: workers killed by the watchdog"
                    _kill(proc)
                    break
                # (not while benchmarking: a launch's imports beside a timed op would skew its time)
                if not standby and not plan.bench and _running_for(collector) > _standby_after(plan):
                    standby.append(_Launch(run_dir / "workers" / f"w{world_size}-launch{attempt + 1}", world_size))
                time.sleep(POLL_SECONDS)
        except BaseException:
            _kill(proc)
            raise
        proc.wait()
        for item in collector.poll():
            progress.update(task, advance=1)
        unfinished = collector.unfinished()
        if not unfinished:
            return
        log_text = log_path.read_text(errors="replace")
        failed = collector.in_flight() or unfinished[0]
        if not collector.state[failed.id].started and not collector.finished:
            # The launch died before running anything: every remaining item is an error.
            why = _error_lines(log_text) or f"torchrun exited with code {proc.returncode}"
            for item in unfinished:
                collector.abort(item, f"worker launch failed: {why} (log: {log_path})")
                progress.update(task, advance=1)
            return
        cause = collector.abort(failed, watchdog_reason, deaths=dead_ranks(log_text))
        progress.update(task, advance=1)
        remaining = [i for i in unfinished if i.id != failed.id]
        if hang_budget:
            dp, cp, tp = failed.topology
            reason = (f"skipped: {failed.op} {cause} in case {failed.case_id} {failed.dtype} at dp{dp}-cp{cp}-tp{tp}; "
                      f"its other items at this topology are not run (--no-hang-budget runs them)")
            for item in remaining:
                if (item.op, item.topology) == (failed.op, failed.topology):
                    collector.skip(item, reason)
                    progress.update(task, advance=1)
            remaining = [i for i in remaining if i.id not in collector.finished]
        attempt += 1


def _children(pid: int) -> list[int]:
    """Direct children of `pid` (Linux /proc; empty elsewhere)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _kill(proc: subprocess.Popen) -> None:
    """End a torchrun launch and its workers.  torchrun starts each worker in a session of its own, so
    killing torchrun's process group would orphan them (a standby waiting for its plan, a rank stuck in
    a collective): the workers are killed by pid, then torchrun's group."""
    workers = _children(proc.pid)
    for pid in workers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
