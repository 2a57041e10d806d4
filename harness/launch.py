"""Driver: a launch of worker processes per world size, kept up for all its items (and, in a
`WorkerPool`, for every later plan of that size).

The driver starts the ranks itself (`python -m harness.worker`, one process each, RANK and
WORLD_SIZE set): no torchrun between them, so a rank's exit status is known directly.  A
launch that ends early (a peer stuck past --timeout, a rank that crashed or was killed) turns
the item in flight into error rows naming the ranks, and the remaining items get a new
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
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from harness.artefacts import ArtefactBudget
from harness.collect import Collector
from harness.events import EXIT_PEER_STUCK, STOP
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


def _worker_env(rank: int, world_size: int) -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # ranks share the cores; one thread each avoids thrashing
    env["PYTHONUNBUFFERED"] = "1"
    # The source tree must be importable by the workers whether or not it is installed.
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
               GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(world_size))
    return env


def _exit_words(returncode: int) -> str:
    """'SIGKILL' for a process killed by a signal, else 'exit code N'."""
    return _signal_name(-returncode) if returncode < 0 else f"exit code {returncode}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _error_lines(log_text: str) -> str:
    lines = [ln for ln in log_text.splitlines() if re.search(r"Error|error:|Exception|Killed", ln)]
    return lines[-1].strip()[:300] if lines else ""


@dataclass(frozen=True)
class LaunchSettings:
    """What a launch's ranks are started with; a plan runs only on a launch of its own settings."""

    device: str
    backend: str
    timeout: float
    shims: bool

    @classmethod
    def of(cls, plan: Plan) -> "LaunchSettings":
        return cls(plan.device, plan.backend, plan.timeout, plan.shims)


class WorkerPool:
    """Launches kept up between plans, at most one idle launch per world size: a plan run with the pool takes its
    launches from it and gives them back when every item finished, so a session of many small plans (`shardcheck
    fuzz`: one per example) pays one start-up per world size.  `start` starts launches before any plan exists (their
    imports and rendezvous overlap the driver's planning).  Use as a context manager: leaving it ends every launch."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.idle: dict[int, _Launch] = {}
        self._launches: dict[int, int] = {}  # world size -> launches started (their folders: w<size>-launch<n>)
        self._lock = threading.Lock()

    def start(self, world_sizes, settings: LaunchSettings) -> None:
        for world_size in sorted(set(world_sizes)):
            with self._lock:
                if world_size not in self.idle:
                    self.idle[world_size] = self._new(world_size, settings)

    def _new(self, world_size: int, settings: LaunchSettings) -> "_Launch":
        n = self._launches.get(world_size, 0)
        self._launches[world_size] = n + 1
        return _Launch(self.run_dir / "workers" / f"w{world_size}-launch{n}", world_size, settings)

    def take(self, world_size: int, settings: LaunchSettings) -> "_Launch":
        """An idle launch of this size and settings that is still up, else a new one."""
        with self._lock:
            launch = self.idle.pop(world_size, None)
            if launch is not None and (launch.settings != settings or launch.ended()):
                launch.discard()
                launch = None
            return launch or self._new(world_size, settings)

    def give_back(self, launch: "_Launch") -> None:
        with self._lock:
            old = self.idle.get(launch.world_size)
            if old is not None and old is not launch:
                old.discard()
            self.idle[launch.world_size] = launch

    def standby(self, world_size: int, settings: LaunchSettings) -> "_Launch":
        """A launch started ahead for the next attempt of a world size (not idle: it belongs to the caller)."""
        with self._lock:
            return self._new(world_size, settings)

    def keep_only(self, world_sizes) -> None:
        """End the idle launches of other world sizes (started ahead for a plan that turned out not to need them)."""
        with self._lock:
            for world_size in [w for w in self.idle if w not in set(world_sizes)]:
                self.idle.pop(world_size).discard()

    def close(self) -> None:
        with self._lock:
            for launch in self.idle.values():
                launch.discard()
            self.idle.clear()
        folder = self.run_dir / "workers"
        try:
            folder.rmdir()  # only when empty: a launch whose events hold rows keeps its folder
        except OSError:
            pass

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_plan(plan: Plan, run_dir: Path, writer: RecordWriter, show_progress: bool, hang_budget: bool = True,
             artefacts: ArtefactBudget | None = None, pool: WorkerPool | None = None) -> None:
    """Run every item of `plan`, one launch per world size (more after a hang or death); rows go to `writer`.
    With a `pool`, launches come from it and go back to it when every item finished; without one, they end here."""
    if pool is None:
        with WorkerPool(run_dir) as own:
            return run_plan(plan, run_dir, writer, show_progress, hang_budget, artefacts, own)
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
        args = (run_dir, writer, progress, task, hang_budget, artefacts, stop, pool)
        if plan.device != "cpu" or plan.bench or len(worlds) <= 1:
            for world_size, items in worlds:
                _run_world(plan, items, world_size, *args)
            return
        with ThreadPoolExecutor(max_workers=len(worlds), thread_name_prefix="shardcheck-launch") as threads:
            futures = [threads.submit(_run_world, plan, items, world_size, *args) for world_size, items in worlds]
            try:
                for future in futures:
                    future.result()
            except BaseException:
                stop.set()  # the other launch threads kill their workers and return
                raise


class _Launch:
    """`world_size` worker processes writing to `launch_dir`; they rendezvous, then wait for plan<k>.json, so a
    launch can be started (imports, rendezvous) before its plan is known, and serve plan after plan."""

    def __init__(self, launch_dir: Path, world_size: int, settings: LaunchSettings):
        launch_dir.mkdir(parents=True, exist_ok=True)
        self.dir, self.world_size, self.settings = launch_dir, world_size, settings
        self.log_path = launch_dir / "workers.log"
        self.plans_given = 0
        self.killed = False
        cmd = [sys.executable, "-m", "harness.worker", "--launch-dir", str(launch_dir),
               "--plan-wait", f"{STANDBY_WAIT:g}", "--launch-device", settings.device,
               "--launch-backend", settings.backend, "--launch-timeout", f"{settings.timeout:g}",
               *([] if settings.shims else ["--launch-no-shims"])]
        with open(self.log_path, "ab") as log:  # every rank appends to the one log
            self.procs = [subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_worker_env(rank, world_size),
                                           start_new_session=True) for rank in range(world_size)]

    def give_plan(self, plan: Plan) -> tuple[Path, float]:
        """Write the next plan (atomically: the ranks poll for it); returns the folder its events go to, and when."""
        k = self.plans_given
        self.plans_given += 1
        tmp = self.dir / f"plan{k}.json.tmp"
        tmp.write_text(plan.to_json())
        os.replace(tmp, self.dir / f"plan{k}.json")
        return self.dir / f"plan{k}", time.time()

    def stop(self, wait: float) -> None:
        """Ask the ranks to exit (after their current plan) and wait up to `wait` seconds; then kill what is left."""
        tmp = self.dir / f"plan{self.plans_given}.json.tmp"
        tmp.write_text(STOP)
        os.replace(tmp, self.dir / f"plan{self.plans_given}.json")
        deadline = time.time() + wait
        for proc in self.procs:
            try:
                proc.wait(timeout=max(deadline - time.time(), 0.01))
            except subprocess.TimeoutExpired:
                break
        self.kill()

    def ended(self) -> bool:
        """Whether some rank has exited (a launch is only ever ended whole)."""
        return any(proc.poll() is not None for proc in self.procs)

    def deaths(self) -> dict[int, str]:
        """Ranks whose process ended by itself ({rank: 'SIGKILL' | 'exit code 13'}), read before `kill`: an external
        kill -9, the OOM killer, a segfault, an exit.  Our own exit after a stuck peer is not one."""
        return {rank: _exit_words(proc.returncode) for rank, proc in enumerate(self.procs)
                if proc.poll() is not None and proc.returncode != EXIT_PEER_STUCK}

    def kill(self) -> None:
        """End every rank (each leads a session of its own: what it started goes too)."""
        self.killed = True
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            proc.wait()

    def discard(self) -> None:
        """End it; its folder goes too unless it ran a plan (its events and log are the run's)."""
        self.kill()
        if not self.plans_given:
            shutil.rmtree(self.dir, ignore_errors=True)


def _running_for(collector: Collector) -> float:
    """Seconds the item in flight has been running (0 when none is)."""
    item = collector.in_flight()
    return time.time() - min(collector.state[item.id].started.values()) if item else 0.0


def _run_world(plan: Plan, items: list[Item], world_size: int, run_dir: Path, writer: RecordWriter,
               progress: Progress, task, hang_budget: bool, artefacts: ArtefactBudget, stop: threading.Event,
               pool: WorkerPool) -> None:
    standby: list[_Launch] = []  # at most one launch started ahead for the next attempt
    try:
        _run_launches(plan, items, world_size, writer, progress, task, hang_budget, artefacts, standby, stop, pool)
    except _Stopped:
        pass  # another launch thread ended the run; its exception is the one raised
    finally:
        for launch in standby:  # started ahead but never needed
            launch.discard()


class _Stopped(Exception):
    """The run is ending early: a launch thread stops its workers."""


def _run_launches(plan: Plan, items: list[Item], world_size: int, writer: RecordWriter, progress: Progress, task,
                  hang_budget: bool, artefacts: ArtefactBudget, standby: list[_Launch], stop: threading.Event,
                  pool: WorkerPool) -> None:
    """Launch after launch until every item of this world size has a row; `standby` holds the launch
    started ahead for the next attempt, if any."""
    settings = LaunchSettings.of(plan)
    remaining = items
    while remaining:
        launch = standby.pop() if standby else None
        if launch is not None and launch.ended():  # the standby failed by itself: start afresh
            launch.discard()
            launch = None
        launch = launch or pool.take(world_size, settings)
        events_dir, started = launch.give_plan(Plan(**{**plan.__dict__, "items": remaining,
                                                       "failure_artefacts": artefacts.left}))
        events_dir.mkdir(parents=True, exist_ok=True)
        collector = Collector(plan, remaining, events_dir, writer, world_size, artefacts)
        watchdog_reason = ""
        try:
            while not launch.ended():
                if stop.is_set():
                    raise _Stopped
                for item in collector.poll():
                    progress.update(task, advance=1, description=f"{item.op.split('.', 1)[1]} {item.dtype} "
                                                                 f"dp{item.topology[0]}cp{item.topology[1]}tp{item.topology[2]}")
                if collector.all_finished():  # every rank reported every item
                    break
                quiet = time.time() - max(collector.last_event, started)
                if quiet > plan.timeout + WATCHDOG_GRACE:
                    watchdog_reason = f"no progress for {quiet:.0f}s: workers killed by the watchdog"
                    break
                # (not while benchmarking: a launch's imports beside a timed op would skew its time)
                if not standby and not plan.bench and _running_for(collector) > _standby_after(plan):
                    standby.append(pool.standby(world_size, settings))
                time.sleep(POLL_SECONDS)
        except BaseException:
            launch.kill()
            raise
        deaths = {} if watchdog_reason else launch.deaths()  # before our own kill adds to them
        if collector.all_finished() and not deaths:
            if plan.profile:  # the ranks write their profiles as they exit
                launch.stop(wait=60)
            else:
                pool.give_back(launch)
            for item in collector.poll():
                progress.update(task, advance=1)
            return
        launch.kill()
        for item in collector.poll():
            progress.update(task, advance=1)
        unfinished = collector.unfinished()
        if not unfinished:
            return
        log_text = launch.log_path.read_text(errors="replace")
        failed = collector.in_flight() or unfinished[0]
        if not collector.state[failed.id].started and not collector.finished:
            # The launch died before running anything: every remaining item is an error.
            codes = ", ".join(f"rank {r}: {w}" for r, w in sorted(deaths.items()))
            why = _error_lines(log_text) or (f"workers exited ({codes})" if codes else "workers exited")
            for item in unfinished:
                collector.abort(item, f"worker launch failed: {why} (log: {launch.log_path})")
                progress.update(task, advance=1)
            return
        cause = collector.abort(failed, watchdog_reason, deaths=deaths)
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
