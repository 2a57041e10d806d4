"""Worker: one process per rank; runs the items of one plan after another.

    # started by the driver (shardcheck.harness.driver.launch), RANK and WORLD_SIZE set:
    python -m shardcheck.harness.rank.worker --launch-dir DIR ...
    # by hand:
    torchrun --nnodes 2 ... -m shardcheck.harness.standalone --suite model_utils --out shardcheck-runs/x

Started by the driver, the ranks rendezvous first (rank 0 hosts the store on a free port and writes it to
DIR/store-port), then wait for DIR/plan0.json, run it, wait for DIR/plan1.json, and so on: a launch is started
before its plan is known and serves every plan of its world size (`shardcheck fuzz` sends one per example).  Each
rank appends its events of plan k (start, phase, check, error, done) to DIR/plan<k>/rank<R>.jsonl; the driver
merges them into result rows.  When started by hand, rank 0 does the merging itself (the out dir must then be on
a filesystem all nodes share).

One item's run (golden, call, backward, judging, its rows) is harness/rank/item_run.py; this module is the rank
process around it: the process group and meshes, the plans, the loop over their items, the barrier after each.

Never hang: after each item every rank checks in at a store barrier.  If a peer does not arrive within the plan's
timeout (it skipped a collective, or is blocked in one, or died) the ranks that did arrive record who is missing
and exit; the driver ends the launch and relaunches for the remaining items.
"""

from __future__ import annotations

import argparse
import cProfile
import faulthandler
import itertools
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from shardcheck.harness.core.events import (
    EXIT_DRIVER_GONE,
    EXIT_PEER_STUCK,
    PIECES,
    STOP,
    Events,
    events_path,
    stack_path,
)
from shardcheck.harness.core.measure import group_dims
from shardcheck.harness.core.model_case import step_order
from shardcheck.harness.core.options import PEER_WAIT, STORE_CONNECT_WAIT
from shardcheck.harness.core.plan_data import Item, Plan
from shardcheck.harness.core.records import Phase
from shardcheck.harness.core.topology import Topology, build_mesh
from shardcheck.harness.rank import flight_recorder, gloo_device, shims
from shardcheck.harness.rank.bench import run_bench_item
from shardcheck.harness.rank.golden import GoldenCache, share_folder
from shardcheck.harness.rank.item_run import ItemRun
from shardcheck.harness.rank.loaded_plan import LoadedPlan, plan_cases, plan_impls

STUCK_LINGER = 5.0  # seconds a rank that found a peer missing stays up, so the driver takes every rank's stack first
RAISED_GRACE = 10.0  # seconds the ranks at an item's barrier still wait for their peers once one of them raised
BARRIER_SLICE = 1.0  # how often a rank waiting at the barrier looks whether a peer raised


class Worker:
    """One rank: its process group, kept for every plan it runs (`load` one, then `run` it)."""

    def __init__(
        self,
        device: str,
        backend: str,
        use_shims: bool,
        *,
        store: dist.Store | None = None,
        rank: int | None = None,
        world: int | None = None,
    ):
        self.device = torch.device(device)
        self.backend = backend
        if self.device.type == "cuda":
            # nccl: one GPU per rank; gloo on a shared GPU: ranks share device 0 (or wrap around)
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
            self.device = torch.device("cuda", torch.cuda.current_device())
        # (a launch serves plans of any --timeout: the plan's timeout ends a hung item, PEER_WAIT is a backstop)
        pg_timeout = timedelta(seconds=PEER_WAIT)
        gloo_device.install()  # one event loop for all the rank's gloo groups, not one per group
        if store is None:  # torchrun's environment
            dist.init_process_group(backend, timeout=pg_timeout)
        else:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=pg_timeout)
        if use_shims:  # before any module under test runs
            shims.install(self.device.type)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.meshes = {}
        self.plans_loaded = 0
        self.loaded: LoadedPlan | None = None  # the plan `run` runs
        self.recorder = None  # the collective flight recorder (harness/rank/flight_recorder.py), when serving a driver
        self.linger_on_stuck = 0.0  # (the driver's ranks: STUCK_LINGER)
        # A hand-launched rank (harness/standalone.py) has no driver to ask for its stack: it dumps it itself, into
        # this file, when an item is still running at --timeout (faulthandler's own timer thread, answered while
        # the rank spins or blocks in C++).
        self.dump_stacks_to = None
        self.current: tuple[Item, float] | None = None  # (the item in flight, its start): a watchdog thread reads it
        self.shim_calls_seen: dict[str, int] = {}  # (shims.calls() after the last item)
        # The folder of the launches' folders, where the ranks of a driver's launches share goldens (one machine:
        # harness/rank/golden.py); None for a hand-launched rank, which works out its own.
        self.golden_share: Path | None = None

    def load(self, plan: Plan, events_dir: Path) -> None:
        """Make `plan` the one `run` runs; its events go to `events_dir`."""
        # Item ids start at 0 in every plan: each plan checks in under keys of its own.
        store = dist.PrefixStore(f"shardcheck-items/{self.plans_loaded}", dist.distributed_c10d._get_default_store())
        self.plans_loaded += 1
        if self.loaded is not None:
            self.loaded.events.file.close()
        events = Events(events_path(events_dir, self.rank), self.rank)
        self.loaded = LoadedPlan(
            plan=plan,
            events=events,
            events_dir=events_dir,
            store=store,
            device=self.device,
            rank=self.rank,
            world=self.world,
            cases=plan_cases(plan),
            impls=plan_impls(plan),
            ops_with_signature_rows={i.op for i in plan.items} | set(plan.missing_ops),
            goldens=GoldenCache(
                share_folder(self.golden_share, plan.run_id) if self.golden_share else None, self.rank, plan.timeout
            ),
        )

    def mesh(self, topo: Topology):
        if topo not in self.meshes:
            self.meshes[topo] = build_mesh(topo, self.world, self.device.type)
        return self.meshes[topo]

    def run(
        self, on_item_done: Callable[[Item], None] | None = None, on_stuck: Callable[[Item], None] | None = None
    ) -> None:
        """Every item of the loaded plan for this world size, each followed by the store barrier; exits the process
        when a peer does not arrive."""
        loaded = self.loaded
        for item in loaded.plan.items:
            if item.world_size != self.world:
                continue
            started = time.time()
            self.current = (item, started)
            pieces = self._run_item(item)
            missing = self._check_in(item, started)
            if missing:
                loaded.events.stuck(item.id, missing, round(time.time() - started, 1))
                loaded.events.file.flush()
                if on_stuck:
                    on_stuck(item)
                # The missing peer is still inside its collective: the driver takes every rank's stack (and ends
                # the launch) now, before this rank's exit closes the peer's connections and moves it on.
                time.sleep(self.linger_on_stuck)
                os._exit(EXIT_PEER_STUCK)  # a peer is blocked or dead: the driver ends the launch
            self.current = None
            if pieces and loaded.store.check([f"failed/{item.id}"]):
                self.save_pieces(item, self._first_divergence(item, pieces))
            loaded.events.done(item.id, time.time() - started, self._new_shim_calls())
            if on_item_done:
                on_item_done(item)

    def _run_item(self, item: Item) -> dict[str, dict]:
        """One item on this rank (replica 0 of the topology runs it, the other replicas wait); the tensors it kept
        for failure artefacts, after telling the peers whether it failed and, of a model's step, where first."""
        loaded = self.loaded
        loaded.events.started(item.id)
        if self.dump_stacks_to is not None:
            faulthandler.dump_traceback_later(loaded.plan.timeout, file=self.dump_stacks_to)
        topo = item.full_topology
        new_mesh = topo not in self.meshes  # (one that fails fails the topology: the driver skips its other items)
        if new_mesh:
            loaded.events.phase(item.id, Phase.MESH)
        mesh = self.mesh(topo)
        if new_mesh:
            loaded.events.phase(item.id, Phase.SETUP)
        if self.recorder is not None:
            self.recorder.begin_item(self.plans_loaded - 1, item.id, group_dims(mesh))
        if self.rank >= topo.size:
            return {}
        run = ItemRun(loaded, item, topo, mesh)
        # the planner's reason (the case's shapes cannot be laid out at this topology) or the case's own
        skip_reason = item.skip or loaded.cases[(item.op, item.case_id)].skip_reason
        if skip_reason:
            run.skip(skip_reason)
            return run.pieces
        try:
            if loaded.plan.bench:
                run_bench_item(run)
            else:
                run.run()
        except Exception as exc:  # the op's own exceptions are caught in its steps: this one is ours
            run.emit_harness_error(exc)
        self._flag_failures(item, run.pieces)
        return run.pieces

    def _flag_failures(self, item: Item, pieces: dict[str, dict]) -> None:
        """Tell the peers, through the store, that this rank has a failing piece (they save theirs too) and which
        check of a model's step failed first here."""
        # (a known failure's checks keep the artefact budget for real ones)
        if any(p["failed"] and not (item.xfail and item.xfail.covers(c)) for c, p in pieces.items()):
            self.loaded.store.set(f"failed/{item.id}", "1")
        failing_steps = [c for c, p in pieces.items() if p["failed"] and step_order(c) is not None]
        if failing_steps:  # a model's step: the ranks agree on its first divergence (after the barrier)
            self.loaded.store.set(f"first/{item.id}/{self.rank}", min(failing_steps, key=step_order))

    def _check_in(self, item: Item, started: float) -> list[int]:
        """The item's barrier: the ranks missing at its deadline."""
        try:
            missing = self.barrier(item, started + self.loaded.plan.timeout)
        except dist.DistNetworkError:
            # The store's host, rank 0, has exited: it found a peer stuck (or died), and the driver is ending
            # the launch.  Exit as it did, not with a traceback a quick exit would make look like a death.
            self.loaded.events.file.flush()
            os._exit(EXIT_PEER_STUCK)
        if self.dump_stacks_to is not None:
            faulthandler.cancel_dump_traceback_later()
        return missing

    def _new_shim_calls(self) -> dict[str, int]:
        """The calls each CPU shim handled since the last item (the run's notes say whether a shim was used)."""
        now, seen = shims.calls(), self.shim_calls_seen
        self.shim_calls_seen = now
        return {name: n - seen.get(name, 0) for name, n in now.items() if n > seen.get(name, 0)}

    def _first_divergence(self, item: Item, pieces: dict[str, dict]) -> dict[str, dict]:
        """The pieces to keep of a failing model step: its first divergence on any rank, not every module after it
        (other checks' pieces as they are)."""
        store = self.loaded.store
        keys = [f"first/{item.id}/{r}" for r in range(self.world)]
        firsts = [store.get(k).decode() for k in keys if store.check([k])]
        if not firsts:
            return pieces
        first = min(firsts, key=step_order)
        return {c: p for c, p in pieces.items() if step_order(c) is None or c == first}

    def save_pieces(self, item: Item, pieces: dict[str, dict]) -> None:
        """This rank's pieces of a failing item, for the driver to reassemble (harness/rank/artefacts.py)."""
        path = self.loaded.events_dir / PIECES / f"item{item.id}" / f"rank{self.rank}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        pieces = {c: _saved_piece(p) for c, p in pieces.items()}
        torch.save(pieces, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)  # the driver never reads a half-written file
        self.loaded.failures_saved += 1

    def barrier(self, item: Item, deadline: float) -> list[int]:
        """Store-based check-in (does not touch the process groups a stuck peer may hold).  Once some rank raised in
        the item, the others wait at most RAISED_GRACE more: a peer still missing then is blocked in a collective
        the raiser left (the item is an error either way), and waiting out the whole --timeout finds nothing more."""
        store = self.loaded.store
        store.set(f"{item.id}/{self.rank}", "1")
        keys = [f"{item.id}/{r}" for r in range(self.world)]
        raised = f"raised/{item.id}"
        while True:
            try:
                store.wait(keys, timedelta(seconds=max(min(deadline - time.time(), BARRIER_SLICE), 0.01)))
                return []
            except dist.DistNetworkError:  # the store is gone: for the caller
                raise
            except Exception:  # DistStoreError on timeout
                now = time.time()
                if now >= deadline:
                    return [r for r, k in enumerate(keys) if not store.check([k])]
            # Asked only once a slice passed without every peer: the ranks of nearly every item arrive within it, and
            # a store request is a round trip to rank 0 (one per rank and item, 10,000 in the default run).
            if raised and store.check([raised]):
                deadline = min(deadline, now + min(RAISED_GRACE, self.loaded.plan.timeout))
                raised = ""  # the grace counts from when this rank first saw it


def _saved_piece(piece: dict) -> dict:
    """A kept piece as the driver reads it (harness/rank/artefacts.py): on the CPU, with its indices in the full
    tensor instead of its placement (worked out here, for a failing item alone: most pieces are never saved)."""
    place = piece["place"]
    saved = {k: v for k, v in piece.items() if k != "place"}
    saved["indices"] = place.layout.mesh_indices(piece["full_shape"], place.mesh, place.inputs)
    return {**saved, "got": piece["got"].cpu(), "expected": piece["expected"].cpu()}


def _rendezvous(launch_dir: Path, rank: int, world: int) -> dist.Store:
    """The launch's store: rank 0 hosts it on a port the system picks and writes the port to
    LAUNCH_DIR/store-port (written whole, then renamed); the others wait for that file and connect."""
    port_file = launch_dir / "store-port"
    wait = timedelta(seconds=PEER_WAIT)
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=wait, wait_for_workers=False)
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(str(store.port))
        os.replace(tmp, port_file)
        return store
    deadline = time.time() + wait.total_seconds()
    while not port_file.exists():
        if time.time() > deadline:
            raise TimeoutError(f"rank 0 wrote no {port_file}")
        time.sleep(0.01)
    connect = timedelta(seconds=STORE_CONNECT_WAIT)
    store = dist.TCPStore("127.0.0.1", int(port_file.read_text()), world, is_master=False, timeout=connect)
    store.set_timeout(wait)  # the connect is bounded; the store's waits on peers are not
    return store


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only whether the process exists
    except (ProcessLookupError, PermissionError):  # (PermissionError: another user's process took the pid)
        return False
    try:  # a zombie (dead, not yet reaped by its parent) still answers signal 0
        return Path(f"/proc/{pid}/stat").read_text().rpartition(") ")[2][:1] != "Z"
    except OSError:  # no /proc (not Linux)
        return True


def _exit_with_the_driver(driver: int) -> None:
    """End this rank once its driver is gone, whatever the rank is doing: a driver killed outright (SIGKILL, a CI
    job's cancel) cannot end its ranks, and one mid-item (computing the rest of its plan, or blocked in a collective
    whose peer is gone, under PEER_WAIT's hour) or waiting for its next plan would otherwise outlive it by minutes.
    (The driver, not the parent: a forked rank's parent is the fork server, which lives as long as any process it
    forked.)"""

    def watch() -> None:
        while _alive(driver):
            time.sleep(1.0)
        os._exit(EXIT_DRIVER_GONE)

    threading.Thread(target=watch, name="shardcheck-driver-watch", daemon=True).start()


def _wait_for(path: Path, seconds: float) -> bool:
    """Whether `path` appeared within `seconds` (a rank whose driver died meanwhile is ended by its driver watch)."""
    start = time.time()
    while not path.exists():
        waited = time.time() - start
        if waited > seconds:
            return False
        # 10 ms while a plan is due (the driver writes the next at once), 50 ms for a launch kept idle in a pool
        time.sleep(0.01 if waited < 1.0 else 0.05)
    return True


def serve(launch_dir: Path, plan_wait: float, device: str, backend: str, use_shims: bool) -> int:
    """The driver's rank: rendezvous, then run LAUNCH_DIR/plan0.json, plan1.json, ... as they come; exit when a plan
    file says STOP or none comes within `plan_wait` seconds.  Each plan's settings (its --timeout) are its own."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    driver = int(os.environ.get("SHARDCHECK_DRIVER_PID", os.getppid()))
    # (forked ranks all show the fork server's command line: this names the process of each rank)
    (launch_dir / f"rank{rank}.pid").write_text(str(os.getpid()))
    _exit_with_the_driver(driver)
    # Every thread's Python stack on SIGUSR1, written by faulthandler's C handler: it runs while this rank is
    # blocked in C++ (a gloo wait) or spinning in Python; the driver asks before it ends a hung launch.
    stacks = open(stack_path(launch_dir, rank), "a")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True, chain=False)
    store = _rendezvous(launch_dir, rank, world)
    worker = Worker(device, backend, use_shims, store=store, rank=rank, world=world)
    worker.recorder = flight_recorder.install(launch_dir, rank) if flight_recorder.enabled() else None
    worker.linger_on_stuck = STUCK_LINGER
    worker.golden_share = launch_dir.parent
    profile = None
    for k in itertools.count():
        path = launch_dir / f"plan{k}.json"
        if not _wait_for(path, plan_wait):
            break
        text = path.read_text()
        if text == STOP:
            break
        plan = Plan.from_json(text)
        if (
            plan.profile and profile is None
        ):  # `shardcheck run --profile`: this rank's cProfile, read by reports/profile.py
            profile = cProfile.Profile()
            profile.enable()
        worker.load(plan, launch_dir / f"plan{k}")
        worker.run()
        if profile is not None:
            profile.disable()
            out = Path(plan.profile) / f"w{world}-rank{rank}-{os.getpid()}.prof"
            out.parent.mkdir(parents=True, exist_ok=True)
            profile.dump_stats(out)
            profile.enable()
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardcheck.harness.rank.worker")
    parser.add_argument(
        "--launch-dir", type=Path, help="the launch's folder: plans come, events go there (driver mode)"
    )
    parser.add_argument("--plan-wait", type=float, default=900.0, help="seconds to wait for each plan")
    parser.add_argument("--launch-device", default="cpu")
    parser.add_argument("--launch-backend", default="gloo")
    parser.add_argument("--launch-no-shims", action="store_true")
    parser.epilog = (
        "started by the driver; a torchrun written by hand runs `-m shardcheck.harness.standalone`, "
        "which plans, runs this worker on every rank and collects"
    )
    args = parser.parse_args(argv)
    if not args.launch_dir:
        parser.error("--launch-dir is required (a torchrun written by hand runs -m shardcheck.harness.standalone)")
    return serve(
        args.launch_dir,
        args.plan_wait,
        args.launch_device,
        args.launch_backend,
        not args.launch_no_shims,
    )


if __name__ == "__main__":
    sys.exit(main())
