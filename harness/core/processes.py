"""Run a function on N fresh ranks: for ops that are about processes, not values.

Barriers, first-rank-per-node sections and other ordering or timing contracts can kill or
wedge the rank that runs them (an op that aborts the job on an exception, a barrier that
never returns).  Such a case does not run the op in the persistent worker: it calls
`run_ranks` from its `run`, which starts `world_size` fresh processes, runs `fn(proc, *args)`
on each and returns what every rank did; the case's `properties` turn that into checks.

    outcome = run_ranks(scenario, world_size=4, nodes=2, args=(module_ref(impl),), deadline=20)
    outcome.ranks[2].exitcode, outcome.ranks[2].error, outcome.events("enter"), outcome.logs

- Ranks: processes forked from a forkserver that has torch imported (a fresh rank costs
  milliseconds, not a torch import).  Each gets torchrun's environment: RANK, WORLD_SIZE,
  MASTER_ADDR=127.0.0.1, MASTER_PORT, and, per simulated node (`nodes` nodes of
  world_size / nodes ranks, node-major), LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, NODE_RANK.
  Like torchrun, this module hosts the TCPStore (TORCHELASTIC_USE_AGENT_STORE=True), so
  `init_process_group()` from the environment works on every rank, in `fn` or in the code
  under test.  `init_process_group=True` initialises gloo before `fn`; `distributed_env=False`
  gives a plain single process (no torch.distributed variables at all).
- Never hangs: at `deadline` seconds after the ranks started, every rank still running is
  killed (SIGKILL) and reported with `killed=True`.
- What comes back, per rank (`RankOutcome`): exit code (negative: the signal), the return
  value of `fn` (pickled) or the exception that escaped it, the events it recorded with
  `proc.event(name, **data)` and the log records emitted through `logging`.  Events and logs
  go to the store as they happen, so a rank killed at the deadline still reports what it did
  before.  Each event and log record carries a wall-clock time and a global sequence number
  (one atomic counter in the store): ordering properties compare sequence numbers, which do
  not depend on clocks or load.
- Ranks can wait for each other's events: `proc.wait_for("returned", ranks=[0, 1], timeout=20)`.

`fn` and its arguments must be picklable (a module-level function; pass modules under test as
`module_ref(module)` and load them in the rank with `load_module`).  As with any multiprocessing
start method but fork, the ranks import the caller's main module: a script calling `run_ranks`
needs the `if __name__ == "__main__":` guard (the worker, pytest and the CLI have it).
"""

from __future__ import annotations

import importlib
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from shardcheck.harness.core.modules import resolve_impl
from shardcheck.harness.core.peer_failure import is_peer_failure

# An exception's attribute naming where a fresh rank raised it, (path, line), for an exception re-raised in the
# process that judges the rank's run: its traceback is another process's text (harness/rank/errors.raising_location).
RAISED_AT = "__shardcheck_raised_at__"
HOST = "127.0.0.1"
# Variables a launcher sets: removed in every fresh rank (it may have been forked from a worker
# started by torchrun), then set again for the simulated job.
LAUNCHER_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)
KEY = "shardcheck-processes/"  # this module's keys in the store (the process group's keys have their own prefix)


@dataclass
class Event:
    rank: int
    name: str
    time: float  # time.time() in the rank
    seq: int  # position in the global order of events and log records of the run
    data: dict = field(default_factory=dict)


@dataclass
class LogRecord:
    rank: int
    logger: str
    level: str
    message: str
    time: float
    seq: int


@dataclass
class RankOutcome:
    rank: int
    node: int
    local_rank: int
    exitcode: int | None  # negative: killed by that signal
    killed: bool  # still running at the deadline: killed by run_ranks
    returned: bool  # fn returned (result holds its value)
    result: Any = None
    error: str | None = None  # "ExceptionType: message" of what escaped fn (or the start-up)
    traceback: str | None = None
    events: list[Event] = field(default_factory=list)
    logs: list[LogRecord] = field(default_factory=list)

    def event(self, name: str) -> Event | None:
        """This rank's first event called `name`."""
        return next((e for e in self.events if e.name == name), None)

    def describe(self) -> str:
        where = f"rank {self.rank} (node {self.node}, local rank {self.local_rank})"
        if self.killed:
            last = self.events[-1].name if self.events else "no event"
            return f"{where}: still running at the deadline, killed (last event: {last})"
        if self.error:
            short = self.error if len(self.error) <= 160 else self.error[:157] + "..."
            return f"{where}: exit code {self.exitcode}, {short}"
        return f"{where}: exit code {self.exitcode}" + (f", returned {self.result!r}" if self.returned else "")


@dataclass
class ProcessRun:
    world_size: int
    nodes: int
    deadline_s: float
    wall_s: float  # from the first rank's start to the last rank's end (or the kill)
    ranks: list[RankOutcome]

    @property
    def timed_out(self) -> bool:
        return any(r.killed for r in self.ranks)

    @property
    def logs(self) -> list[LogRecord]:
        return sorted((rec for r in self.ranks for rec in r.logs), key=lambda rec: rec.seq)

    def events(self, name: str | None = None) -> list[Event]:
        """Every rank's events (those called `name`), in global order."""
        return sorted((e for r in self.ranks for e in r.events if name is None or e.name == name), key=lambda e: e.seq)

    def origin(self) -> RankOutcome | None:
        """The rank whose failure came first: an error of its own (not a peer's closed connection),
        else the first rank that ended non-zero, else one killed at the deadline."""
        failed = [r for r in self.ranks if r.error or (r.exitcode not in (0, None)) or r.killed]
        # a Python exception (it has a traceback) that is not a peer's closed connection; a bare death has none
        own = [r for r in failed if r.error and r.traceback and not is_peer_failure(r.error)]
        if own:
            return min(own, key=lambda r: r.events[-1].seq if r.events else -1)
        return failed[0] if failed else None

    def describe(self) -> str:
        return "; ".join(r.describe() for r in self.ranks)


class RankProcess:
    """What `fn` gets in a fresh rank: who it is, events, waiting for peers, the store."""

    def __init__(self, rank: int, world_size: int, nodes: int, store: dist.Store):
        self.rank, self.world_size, self.nodes = rank, world_size, nodes
        self.local_world_size = world_size // nodes
        self.node, self.local_rank = divmod(rank, self.local_world_size)
        self.store = dist.PrefixStore(KEY + "user/", store)  # free for fn's own keys
        self._store = store
        self._n_events = 0

    def next_seq(self) -> int:
        return self._store.add(KEY + "seq", 1)

    def event(self, name: str, **data) -> Event:
        """Record (and publish at once) that this rank reached `name`; `data` must be JSON-able."""
        ev = Event(self.rank, name, time.time(), self.next_seq(), data)
        self._store.set(f"{KEY}event/{self.rank}/{self._n_events}", json.dumps(ev.__dict__))
        self._n_events += 1
        self._store.set(f"{KEY}n_events/{self.rank}", str(self._n_events))
        self._store.set(f"{KEY}reached/{name}/{self.rank}", "1")
        return ev

    def wait_for(self, name: str, ranks: list[int], timeout: float) -> bool:
        """Block until every rank in `ranks` recorded event `name` (True) or `timeout` seconds passed (False).
        Polls: a timed-out store wait would leave a reply in flight on the connection."""
        keys = [f"{KEY}reached/{name}/{r}" for r in ranks]
        end = time.monotonic() + timeout
        while not self._store.check(keys):
            if time.monotonic() >= end:
                return False
            time.sleep(0.005)
        return True


class _StoreLogHandler(logging.Handler):
    """Publishes every log record of the rank to the store as it is emitted."""

    def __init__(self, proc: RankProcess):
        super().__init__(logging.DEBUG)
        self.proc, self.count = proc, 0

    def emit(self, record: logging.LogRecord) -> None:
        try:
            rec = LogRecord(
                self.proc.rank, record.name, record.levelname, record.getMessage(), record.created, self.proc.next_seq()
            )
            self.proc._store.set(f"{KEY}log/{self.proc.rank}/{self.count}", json.dumps(rec.__dict__))
            self.count += 1
            self.proc._store.set(f"{KEY}n_logs/{self.proc.rank}", str(self.count))
        except Exception:  # logging must never take the rank down
            self.handleError(record)


def module_ref(module: ModuleType) -> str:
    """How a fresh rank finds `module` again: its file when it was loaded from one by
    `shardcheck.harness.core.modules.resolve_impl` (`--impl FAMILY=path.py`), else its dotted name."""
    if module.__name__.startswith("shardcheck_impl_") and getattr(module, "__file__", None):
        return module.__file__
    return module.__name__


def load_module(ref: str) -> ModuleType:
    """The module `module_ref` described, imported in this (fresh) process."""
    if ref.endswith(".py"):
        return resolve_impl("processes", ref)
    return importlib.import_module(ref)


@dataclass(frozen=True)
class RankLaunch:
    """What every fresh rank of one `run_ranks` call starts from (run_ranks' arguments, and the port of its store)."""

    fn: Callable
    args: tuple
    world_size: int
    nodes: int
    port: int
    distributed_env: bool
    init_process_group: bool
    backend: str
    pg_timeout: float
    env: dict[str, str]


def _set_rank_env(launch: RankLaunch, rank: int) -> None:
    """The environment torchrun would give `rank` of the simulated job (none with distributed_env=False), and the
    caller's `env`; a launcher's own variables removed first."""
    for key in list(os.environ):
        if key in LAUNCHER_ENV or key.startswith("TORCHELASTIC_"):
            del os.environ[key]
    per_node = launch.world_size // launch.nodes
    if launch.distributed_env:
        os.environ.update(
            RANK=str(rank),
            WORLD_SIZE=str(launch.world_size),
            MASTER_ADDR=HOST,
            MASTER_PORT=str(launch.port),
            LOCAL_RANK=str(rank % per_node),
            LOCAL_WORLD_SIZE=str(per_node),
            GROUP_RANK=str(rank // per_node),
            NODE_RANK=str(rank // per_node),
            GROUP_WORLD_SIZE=str(launch.nodes),
            TORCHELASTIC_USE_AGENT_STORE="True",
        )
    os.environ.update(launch.env)


def _rank_main(launch: RankLaunch, rank: int) -> None:
    """Entry point of one fresh rank: environment, store, log capture, fn, outcome; exit code 0 or 1."""
    _set_rank_env(launch, rank)
    torch.set_num_threads(1)
    store = dist.TCPStore(HOST, launch.port, is_master=False, timeout=timedelta(seconds=launch.pg_timeout))
    proc = RankProcess(rank, launch.world_size, launch.nodes, store)
    handler = _StoreLogHandler(proc)
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    code = 0
    try:
        if launch.init_process_group:
            dist.init_process_group(launch.backend, timeout=timedelta(seconds=launch.pg_timeout))
            # Every rank has joined before any runs fn: a rank that raises at once in fn tears its group down,
            # and a peer still connecting to it (gloo's full mesh) would fail in setup instead of in the op.
            dist.barrier()
        result = launch.fn(proc, *launch.args)
        store.set(f"{KEY}result/{rank}", pickle.dumps(result))
    except BaseException as exc:  # noqa: BLE001  whatever escaped fn is the outcome
        code = 1
        text = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]
        store.set(f"{KEY}error/{rank}", json.dumps({"error": text, "traceback": traceback.format_exc()[-4000:]}))
    root.removeHandler(handler)
    # No interpreter teardown: a process group left behind (or a peer's) must not block the exit.
    os._exit(code)


# Imported once in the forkserver, so that a fresh rank does not pay for them (seconds each on a
# loaded machine): torch, and what process-level ops on models use (DDP, FSDP2).
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch.distributed.fsdp",
    "shardcheck.harness.core.processes",
)
_FORKSERVER_READY = False


def _noop() -> None:
    pass


def _context(preload: tuple[str, ...]):
    """The forkserver context.  The first call starts the server with PRELOAD and `preload`
    imported (later calls cannot add to it: their ranks import what else they need) and waits
    until it serves, so that start-up never counts against a run's deadline."""
    global _FORKSERVER_READY
    ctx = multiprocessing.get_context("forkserver")
    if not _FORKSERVER_READY:
        ctx.set_forkserver_preload(list(dict.fromkeys(PRELOAD + tuple(preload))))
        warm_up = ctx.Process(target=_noop, daemon=True)
        warm_up.start()
        warm_up.join()
        _FORKSERVER_READY = True
    return ctx


def run_ranks(
    fn: Callable,
    world_size: int,
    *,
    args: tuple = (),
    nodes: int = 1,
    deadline: float = 20.0,
    init_process_group: bool = False,
    distributed_env: bool = True,
    backend: str = "gloo",
    pg_timeout: float = 60.0,
    env: dict[str, str] | None = None,
    preload: tuple[str, ...] = (),
) -> ProcessRun:
    """Run `fn(proc, *args)` on `world_size` fresh ranks (`nodes` simulated nodes); return every
    rank's outcome.  Ranks still running `deadline` seconds after the start are killed.
    `pg_timeout`: the store's and the process group's timeout (keep it above `deadline`, so that a
    hang is seen as a hang, not as a timeout error inside the rank).  `preload`: modules worth
    importing once for all ranks (see `_context`); `fn`'s own module always is."""
    if world_size < 1 or nodes < 1 or world_size % nodes:
        raise ValueError(f"world_size {world_size} must be a positive multiple of nodes {nodes}")
    ctx = _context(tuple(preload) + (fn.__module__,))
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=pg_timeout))
    per_node = world_size // nodes
    launch = RankLaunch(
        fn=fn,
        args=tuple(args),
        world_size=world_size,
        nodes=nodes,
        port=store.port,
        distributed_env=distributed_env,
        init_process_group=init_process_group,
        backend=backend,
        pg_timeout=pg_timeout,
        env=dict(env or {}),
    )
    procs = [
        ctx.Process(target=_rank_main, daemon=True, name=f"shardcheck-rank{r}", args=(launch, r))
        for r in range(world_size)
    ]
    started = time.time()
    killed = _run_until(procs, deadline)
    wall = time.time() - started
    outcomes = [
        _collect(store, r, r // per_node, r % per_node, p.exitcode, k) for r, (p, k) in enumerate(zip(procs, killed))
    ]
    return ProcessRun(world_size=world_size, nodes=nodes, deadline_s=deadline, wall_s=wall, ranks=outcomes)


def _run_until(procs: list[multiprocessing.process.BaseProcess], deadline: float) -> list[bool]:
    """Start `procs` and wait for them to end, at most `deadline` seconds; which were still running then (killed)."""
    try:
        for p in procs:
            p.start()
        end = time.monotonic() + deadline
        while any(p.is_alive() for p in procs) and time.monotonic() < end:
            multiprocessing.connection.wait(
                [p.sentinel for p in procs if p.is_alive()], timeout=max(end - time.monotonic(), 0.0)
            )
        return [p.is_alive() for p in procs]
    finally:  # also when the caller is interrupted: never leave ranks behind
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join()


def _collect(
    store: dist.Store, rank: int, node: int, local_rank: int, exitcode: int | None, killed: bool
) -> RankOutcome:
    def count(key: str) -> int:
        return int(store.get(key)) if store.check([key]) else 0

    events = [Event(**json.loads(store.get(f"{KEY}event/{rank}/{i}"))) for i in range(count(f"{KEY}n_events/{rank}"))]
    logs = [LogRecord(**json.loads(store.get(f"{KEY}log/{rank}/{i}"))) for i in range(count(f"{KEY}n_logs/{rank}"))]
    out = RankOutcome(
        rank=rank,
        node=node,
        local_rank=local_rank,
        exitcode=exitcode,
        killed=killed,
        returned=False,
        events=events,
        logs=logs,
    )
    if store.check([f"{KEY}result/{rank}"]):
        out.returned, out.result = True, pickle.loads(store.get(f"{KEY}result/{rank}"))
    if store.check([f"{KEY}error/{rank}"]):
        err = json.loads(store.get(f"{KEY}error/{rank}"))
        out.error, out.traceback = err["error"], err["traceback"]
    elif exitcode not in (0, None) and not killed:
        out.error = f"died with {'signal ' + str(-exitcode) if exitcode < 0 else 'exit code ' + str(exitcode)}"
    return out
