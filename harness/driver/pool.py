"""The ranks of a run: a launch of worker processes per world size, and the pool that keeps launches between plans.

Torch-free on purpose: `shardcheck run` starts its ranks' start-up before it imports torch and plans, so that the
two overlap.  CPU ranks are forked from a fork server that has imported what a rank needs, once per driver; CUDA
ranks are processes of their own, each importing torch.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing import forkserver
from pathlib import Path
from typing import TYPE_CHECKING

from shardcheck.harness.core.events import EXIT_PEER_STUCK, STOP
from shardcheck.harness.core.options import LaunchSettings

if TYPE_CHECKING:
    from shardcheck.harness.core.plan_data import Plan

STANDBY_WAIT = 900.0  # seconds a launch's ranks wait for their next plan before they exit
MAX_IDLE_RANKS = 16  # a pool shared by many runs of different settings keeps at most this many ranks idle


def _worker_env(rank: int, world_size: int) -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # ranks share the cores; one thread each avoids thrashing
    env["PYTHONUNBUFFERED"] = "1"
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        ROLE_WORLD_SIZE=str(world_size),
        SHARDCHECK_DRIVER_PID=str(os.getpid()),
    )  # a rank orphaned by a killed driver exits
    return env


# CPU ranks are forked from one process per driver that has imported what a rank needs (harness/rank/preload.py): a
# launch of N ranks then costs no import, where N fresh processes cost N (about 2.5 s of CPU each, most of a one-item
# run).  multiprocessing's fork server: nothing has run there (no thread, no process group) when it forks.  CUDA
# ranks are fresh processes: a fork after CUDA has been touched is not safe, and their host has the cores to import
# side by side.
RANK_PRELOAD = ["shardcheck.harness.rank.preload"]


def preload_in_ranks(modules: list[str]) -> None:
    """Have the fork server import `modules` too (once, for every rank it forks); no effect once it has started: a
    process has one fork server, and its first start decides what it imported."""
    RANK_PRELOAD.extend(m for m in modules if m not in RANK_PRELOAD)


def _fork_server():
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(RANK_PRELOAD)
    return context


def rank_log(launch_dir: Path, rank: int) -> Path:
    """A rank's stdout and stderr: a log per rank, so a dead rank's last words are its own (driver/last_words.py)."""
    return launch_dir / f"rank{rank}.log"


def _forked_rank(env: dict, log_path: str, worker_argv: list[str]) -> None:
    """A rank's life in a process forked from the fork server: `python -P -m shardcheck.harness.rank.worker
    WORKER_ARGV`, as if started afresh with `env`, output to `log_path`, in a session of its own."""
    os.setsid()  # Launch.kill ends the rank's session: whatever it started goes too
    # A rank imports nothing from the working directory by accident (the server inherited the driver's sys.path,
    # which `python -m ...` or `python script.py` starts with it): a user's `reference.py` is no module of ours.
    sys.path[:] = [p for p in sys.path if p not in ("", os.getcwd())]
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update(env)
    import torch

    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # the server's OpenMP read its own environment
    from shardcheck.harness.rank.worker import main

    sys.exit(main(worker_argv))


_LIVE_LAUNCHES: weakref.WeakSet[Launch] = weakref.WeakSet()


@atexit.register  # (registered after multiprocessing's own exit function, so run before it)
def _end_live_launches() -> None:
    """A driver that exits ends its ranks, pool closed or not: multiprocessing would otherwise wait at exit for
    its forked ranks, idle ones for up to STANDBY_WAIT."""
    for launch in list(_LIVE_LAUNCHES):
        launch.kill()


def _exit_words(returncode: int) -> str:
    """'SIGKILL' for a process killed by a signal, else 'exit code N'."""
    return _signal_name(-returncode) if returncode < 0 else f"exit code {returncode}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _returncode(proc) -> int | None:
    """A rank's exit status as subprocess gives it (-N: killed by signal N), None while it runs."""
    return proc.poll() if isinstance(proc, subprocess.Popen) else proc.exitcode


def _wait(proc, timeout: float | None) -> bool:
    """Wait up to `timeout` seconds (None: for ever) for a rank to exit; whether it did."""
    if isinstance(proc, subprocess.Popen):
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True
    proc.join(timeout)
    return proc.exitcode is not None


class WorkerPool:
    """Launches kept up between plans, at most one idle launch per world size and settings: a plan run with the pool
    takes its launches from it and gives them back when every item finished, so a session of many small plans
    (`shardcheck fuzz`: one per example; a test session's runs, `cli.main(argv, pool=...)`) pays one start-up per world
    size.  `start` starts the ranks' start-up before any plan exists, to overlap the driver's planning.  Use as a
    context manager: leaving it ends every launch.  `run_dir` holds the launches' folders."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.idle: dict[tuple[int, LaunchSettings], Launch] = {}  # in the order given back: the oldest first
        self._launches: dict[int, int] = {}  # world size -> launches started (their folders: w<size>-launch<n>)
        self._lock = threading.Lock()

    def start(self, world_sizes, settings: LaunchSettings) -> None:
        """Start the ranks' start-up before their plans exist, without waiting for it: on CPU the fork server (its
        imports; a launch is then forked in milliseconds when taken), elsewhere a launch of each world size."""
        if settings.device == "cpu":
            _fork_server()
            forkserver.ensure_running()
            return
        for world_size in sorted(set(world_sizes)):
            with self._lock:
                if (world_size, settings) not in self.idle:
                    self.idle[world_size, settings] = self._new(world_size, settings)

    def _new(self, world_size: int, settings: LaunchSettings) -> Launch:
        n = self._launches.get(world_size, 0)
        self._launches[world_size] = n + 1
        return Launch(self.run_dir / "workers" / f"w{world_size}-launch{n}", world_size, settings)

    def take(self, world_size: int, settings: LaunchSettings) -> Launch:
        """An idle launch of this size and settings that is still up, else a new one."""
        with self._lock:
            launch = self.idle.pop((world_size, settings), None)
            if launch is not None and launch.ended():
                launch.discard()
                launch = None
            return launch or self._new(world_size, settings)

    def give_back(self, launch: Launch) -> None:
        with self._lock:
            key = (launch.world_size, launch.settings)
            old = self.idle.pop(key, None)
            if old is not None and old is not launch:
                old.discard()
            self.idle[key] = launch
            while sum(w for w, _ in self.idle) > MAX_IDLE_RANKS and len(self.idle) > 1:
                self.idle.pop(next(iter(self.idle))).discard()  # the least recently used

    def standby(self, world_size: int, settings: LaunchSettings) -> Launch:
        """A launch started ahead for the next attempt of a world size (not idle: it belongs to the caller)."""
        with self._lock:
            return self._new(world_size, settings)

    def keep_only(self, world_sizes) -> None:
        """End the idle launches of other world sizes (started ahead for a plan that turned out not to need them)."""
        with self._lock:
            for key in [k for k in self.idle if k[0] not in set(world_sizes)]:
                self.idle.pop(key).discard()

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

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Launch:
    """`world_size` worker processes writing to `launch_dir`; they rendezvous, then wait for plan<k>.json, so a
    launch can be started (imports, rendezvous) before its plan is known, and serve plan after plan."""

    def __init__(self, launch_dir: Path, world_size: int, settings: LaunchSettings):
        launch_dir.mkdir(parents=True, exist_ok=True)
        self.dir, self.world_size, self.settings = launch_dir, world_size, settings
        self.log_paths = [rank_log(launch_dir, rank) for rank in range(world_size)]
        self.plans_given = 0
        self.killed = False
        worker_argv = [
            "--launch-dir",
            str(launch_dir),
            "--plan-wait",
            f"{STANDBY_WAIT:g}",
            "--launch-device",
            settings.device,
            "--launch-backend",
            settings.backend,
            *([] if settings.shims else ["--launch-no-shims"]),
        ]
        _LIVE_LAUNCHES.add(self)
        if settings.device == "cpu":
            server = _fork_server()
            self.procs = [
                server.Process(
                    target=_forked_rank, args=(_worker_env(rank, world_size), str(self.log_paths[rank]), worker_argv)
                )
                for rank in range(world_size)
            ]
            for proc in self.procs:
                proc.start()
        else:
            self.procs = []
            for rank in range(world_size):
                with open(self.log_paths[rank], "ab") as log:
                    self.procs.append(
                        subprocess.Popen(
                            [sys.executable, "-P", "-m", "shardcheck.harness.rank.worker", *worker_argv],
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            env=_worker_env(rank, world_size),
                            start_new_session=True,
                        )
                    )

    def give_plan(self, plan: Plan) -> tuple[Path, float]:
        """Write the next plan (atomically: the ranks poll for it); returns the folder its events go to, and when."""
        k = self.plans_given
        self.plans_given += 1
        tmp = self.dir / f"plan{k}.json.tmp"
        tmp.write_text(plan.to_json())
        os.replace(tmp, self.dir / f"plan{k}.json")
        return self.dir / f"plan{k}", time.time()

    def log_text(self) -> str:
        """Every rank's log, rank by rank."""
        return "".join(p.read_text(errors="replace") for p in self.log_paths if p.exists())

    def pids(self) -> dict[int, int]:
        """{rank: pid} of the ranks still running."""
        return {rank: proc.pid for rank, proc in enumerate(self.procs) if _returncode(proc) is None}

    def stop(self, wait: float) -> None:
        """Ask the ranks to exit (after their current plan) and wait up to `wait` seconds; then kill what is left."""
        tmp = self.dir / f"plan{self.plans_given}.json.tmp"
        tmp.write_text(STOP)
        os.replace(tmp, self.dir / f"plan{self.plans_given}.json")
        deadline = time.time() + wait
        for proc in self.procs:
            if not _wait(proc, max(deadline - time.time(), 0.01)):
                break
        self.kill()

    def ended(self) -> bool:
        """Whether some rank has exited (a launch is only ever ended whole)."""
        return any(_returncode(proc) is not None for proc in self.procs)

    def deaths(self) -> dict[int, str]:
        """Ranks whose process ended by itself ({rank: 'SIGKILL' | 'exit code 13'}), read before `kill`: an external
        kill -9, the OOM killer, a segfault, an exit.  Our own exit after a stuck peer is not one."""
        codes = {rank: _returncode(proc) for rank, proc in enumerate(self.procs)}
        return {rank: _exit_words(code) for rank, code in codes.items() if code not in (None, EXIT_PEER_STUCK)}

    def kill(self) -> None:
        """End every rank (each leads a session of its own: what it started goes too)."""
        self.killed = True
        for proc in self.procs:
            if _returncode(proc) is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:  # a rank forked a moment ago has no session of its own yet: itself
                    proc.kill()
        for proc in self.procs:
            _wait(proc, None)

    def discard(self) -> None:
        """End it; its folder goes too unless it ran a plan (its events and log are the run's)."""
        self.kill()
        if not self.plans_given:
            shutil.rmtree(self.dir, ignore_errors=True)
