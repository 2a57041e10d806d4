"""Driver: a launch of worker processes per world size, kept up for all its items (and, in a
`WorkerPool`, for every later plan of that size).

The driver starts the ranks itself (`python -m shardcheck.harness.rank.worker`, one process each, RANK and
WORLD_SIZE set): no torchrun between them, so a rank's exit status is known directly.  A
launch that ends early (a peer stuck past --timeout, a rank that crashed or was killed) turns
the item in flight into error rows naming the ranks, and the remaining items get a new
launch.  Hang budget: the op's other items at that topology are recorded `skip` ("hung in
case ..."), so a hanging op costs one timeout per topology, not one per item
(`hang_budget=False`, `--no-hang-budget`, tries every item).  A watchdog kills a launch that
reports nothing for --timeout + WATCHDOG_GRACE (10) seconds, its start-up included, so no run ever hangs,
whatever the backend does.
"""

from __future__ import annotations

import contextlib
import cProfile
import re
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from itertools import groupby
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from shardcheck.harness.core.plan_data import Item, Plan
from shardcheck.harness.core.records import Phase, RecordWriter
from shardcheck.harness.driver import postmortem
from shardcheck.harness.driver.collect import Collector
from shardcheck.harness.driver.last_words import EXCEPTION_LINE
from shardcheck.harness.driver.pool import Launch, WorkerPool
from shardcheck.harness.rank.artefacts import ArtefactBudget
from shardcheck.harness.rank.golden import SHARE_FOLDER, share_folder

# A launch that reports nothing for --timeout + WATCHDOG_GRACE seconds is ended: its ranks never came up, or are
# stuck before their first item (a suite's import, the rendezvous).  Start-up counts against it: 16 CPU ranks forked
# from the fork server are up and through a first item within about 1 s of their plan (measured on the shared
# 2-core box at load 18), so 10 s is ample.  CUDA ranks are fresh processes, each importing torch and starting
# CUDA (the pool starts them ahead, while the driver plans): they get START_GRACE_FRESH, a generous guess, not a
# measurement (no GPU where this was written; docs/checks.md says so).
WATCHDOG_GRACE = 10.0
START_GRACE_FRESH = 60.0
# Once an item runs, the driver itself ends it at --timeout + ITEM_GRACE (a rank at the item's barrier reports its
# peers missing at --timeout; when none got there, every rank is stuck in the case): a hang costs --timeout plus
# a few seconds, the stacks taken and the launch ended included, never the watchdog's minute.
ITEM_GRACE = 2.0
POLL_SECONDS = 0.05
# A relaunch starts (imports, rendezvous) while an item that may be hanging waits out its timeout, so
# the start-up does not add to the timeout: a standby launch is started once an item has run a quarter of
# the timeout (at least 2 s, at most 10 s: a start-up takes a few seconds, and a standby never needed costs
# a torch import per rank).


def _standby_after(plan: Plan) -> float:
    return min(10.0, max(2.0, plan.timeout / 4))


def _error_lines(log_text: str) -> str:
    """Why a launch's ranks failed to start, from their logs: the first exception a rank raised (the others' come
    after it, often because of it: a peer that lost rank 0's store), else the last line that names an error."""
    lines = log_text.splitlines()
    raised = [ln for ln in lines if EXCEPTION_LINE.match(ln)]
    named = [ln for ln in lines if re.search(r"Error|error:|Exception|Killed", ln)]
    return (raised[:1] or named[-1:] or [""])[0].strip()[:300]


def run_plan(
    plan: Plan,
    run_dir: Path,
    writer: RecordWriter,
    *,
    show_progress: bool,
    hang_budget: bool = True,
    artefacts: ArtefactBudget | None = None,
    pool: WorkerPool | None = None,
) -> None:
    """Run every item of `plan`, one launch per world size (more after a hang or death); rows go to `writer`.
    With a `pool`, launches come from it and go back to it when every item finished; without one, they end here."""
    if pool is None:
        with WorkerPool(run_dir) as own:
            return run_plan(
                plan,
                run_dir,
                writer,
                show_progress=show_progress,
                hang_budget=hang_budget,
                artefacts=artefacts,
                pool=own,
            )
    try:
        _run_launches(
            plan, run_dir, writer, show_progress=show_progress, hang_budget=hang_budget, artefacts=artefacts, pool=pool
        )
    finally:  # the goldens the ranks shared (harness/rank/golden.py): the run's alone
        shares = pool.run_dir / "workers" / SHARE_FOLDER
        shutil.rmtree(share_folder(pool.run_dir / "workers", plan.run_id), ignore_errors=True)
        with contextlib.suppress(OSError):
            shares.rmdir()  # (only when no other run's are left)


def _run_launches(
    plan: Plan,
    run_dir: Path,
    writer: RecordWriter,
    *,
    show_progress: bool,
    hang_budget: bool,
    artefacts: ArtefactBudget | None,
    pool: WorkerPool,
) -> None:
    artefacts = artefacts if artefacts is not None else ArtefactBudget()
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        transient=False,
        disable=not show_progress,
    )
    stop = threading.Event()  # set when the run ends early (an interrupt, or a launch thread failing)
    with progress:
        task = progress.add_task("checks", total=len(plan.items))
        progress.update(task, advance=_skip_planned(plan, run_dir, writer, artefacts))
        worlds = [
            (_World(plan, w, writer, _Progress(progress, task), hang_budget, artefacts, stop, pool), items)
            for w, items in _by_world(plan)
        ]
        # On CPU the launches of different world sizes run side by side: a launch leaves cores idle while its
        # ranks wait on each other (collectives, the item barrier), and the others fill them.  Not when
        # benchmarking (a neighbour would skew the times), nor on GPUs (launches would share devices).
        if plan.device != "cpu" or plan.bench or len(worlds) <= 1:
            for world, items in worlds:
                _run_world(world, items)
            return
        with ThreadPoolExecutor(max_workers=len(worlds), thread_name_prefix="shardcheck-launch") as threads:
            futures = [threads.submit(_run_world, world, items) for world, items in worlds]
            try:
                for future in futures:
                    future.result()
            except BaseException:
                stop.set()  # the other launch threads kill their workers and return
                raise


def _skip_planned(plan: Plan, run_dir: Path, writer: RecordWriter, artefacts: ArtefactBudget) -> int:
    """Items the planner found the case cannot lay out at their topology: recorded `skip` with its reason, and no
    launch started for them.  Returns how many."""
    skipped = [i for i in plan.items if i.skip]
    if skipped:
        collector = Collector(plan, skipped, run_dir, writer, 0, artefacts)
        for item in skipped:
            collector.skip(item, item.skip)
    return len(skipped)


def _by_world(plan: Plan) -> list[tuple[int, list[Item]]]:
    """The items to run, by the world size of their launch (ascending), each in plan order."""
    to_run = sorted((i for i in plan.items if not i.skip), key=lambda i: (i.world_size, i.id))
    return [(w, list(items)) for w, items in groupby(to_run, key=lambda i: i.world_size)]


@dataclass(frozen=True)
class _Progress:
    """The run's progress bar: one step per item given a row."""

    bar: Progress
    task: TaskID

    def done(self, items: list[Item], describe: bool = False) -> None:
        for item in items:
            if describe:  # the item just checked, by name
                what = f"{item.op.split('.', 1)[1]} {item.dtype} {item.full_topology}"
                self.bar.update(self.task, advance=1, description=what)
            else:
                self.bar.update(self.task, advance=1)


@dataclass
class _World:
    """What one world size's launches run with: the plan, where rows and progress go, the run's shared budget of
    failure artefacts, its stop signal and pool, and the launch started ahead for the next attempt (`standby`)."""

    plan: Plan
    world_size: int
    writer: RecordWriter
    progress: _Progress
    hang_budget: bool
    artefacts: ArtefactBudget
    stop: threading.Event
    pool: WorkerPool
    standby: list[Launch] = field(default_factory=list)  # at most one


@dataclass(frozen=True)
class _Ending:
    """Why a launch's watch ended before every item had a row: an item `hung`, or the watchdog's reason."""

    hung: bool = False
    watchdog_reason: str = ""


def _running_for(collector: Collector) -> float:
    """Seconds the item in flight has been running (0 when none is)."""
    item = collector.in_flight()
    return time.time() - min(collector.state[item.id].started.values()) if item else 0.0


def _watchdog_grace(plan: Plan, collector: Collector) -> float:
    """Seconds past --timeout a launch may go without an event: WATCHDOG_GRACE, or START_GRACE_FRESH before the
    first event of a launch whose ranks are fresh processes (not forked from the CPU fork server)."""
    return WATCHDOG_GRACE if plan.device == "cpu" or collector.last_event else START_GRACE_FRESH


def _hung(collector: Collector, timeout: float) -> bool:
    """Whether the item in flight is stuck: a rank reported a peer missing at its barrier, or it ran past
    --timeout + ITEM_GRACE with no rank at the barrier."""
    item = collector.in_flight()
    return item is not None and bool(collector.state[item.id].stuck or _running_for(collector) > timeout + ITEM_GRACE)


def _run_world(world: _World, items: list[Item]) -> None:
    # --profile: cProfile follows one thread; a launch thread beside the main one keeps its own profile, which the
    # breakdown merges with the driver's (reports/profile.py)
    profiler = _thread_profiler(world.plan)
    try:
        remaining = items
        while remaining:  # launch after launch until every item of this world size has a row
            remaining = _one_launch(world, remaining)
    except _Stopped:
        pass  # another launch thread ended the run; its exception is the one raised
    finally:
        for launch in world.standby:  # started ahead but never needed
            launch.discard()
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(Path(world.plan.profile) / f"driver-launch-w{world.world_size}.prof")


def _thread_profiler(plan: Plan) -> cProfile.Profile | None:
    """A profiler of this launch thread, started, when the run is profiled and this is not the main thread (the
    driver's own profiler covers that one)."""
    if not plan.profile or threading.current_thread() is threading.main_thread():
        return None
    profiler = cProfile.Profile()
    profiler.enable()
    return profiler


class _Stopped(Exception):
    """The run is ending early: a launch thread stops its workers."""


def _one_launch(world: _World, remaining: list[Item]) -> list[Item]:
    """`remaining` on one launch (the standby, an idle one of the pool, or a new one) until each has a row or the
    launch ends early; the items still to run."""
    launch = world.standby.pop() if world.standby else None
    if launch is not None and launch.ended():  # the standby failed by itself: start afresh
        launch.discard()
        launch = None
    launch = launch or world.pool.take(world.world_size, world.plan.settings.launch)
    events_dir, started = launch.give_plan(replace(world.plan, items=remaining, failure_artefacts=world.artefacts.left))
    events_dir.mkdir(parents=True, exist_ok=True)
    collector = Collector(world.plan, remaining, events_dir, world.writer, world.world_size, world.artefacts)
    try:
        ending = _watch(world, launch, collector, started)
    except BaseException:
        launch.kill()
        raise
    return _after_launch(world, launch, collector, ending)


def _watch(world: _World, launch: Launch, collector: Collector, started: float) -> _Ending:
    """Read the launch's events until every rank reported every item, the launch ended, an item hung, or the
    watchdog fired; a standby launch is started once an item has run a while."""
    plan = world.plan
    while not launch.ended():
        if world.stop.is_set():
            raise _Stopped
        world.progress.done(collector.poll(), describe=True)
        if collector.all_finished():  # every rank reported every item
            break
        if _hung(collector, plan.timeout):
            return _Ending(hung=True)
        quiet = time.time() - max(collector.last_event, started)
        if quiet > plan.timeout + _watchdog_grace(plan, collector):
            return _Ending(watchdog_reason=f"no progress for {quiet:.0f}s: workers killed by the watchdog")
        # (not while benchmarking: a launch's imports beside a timed op would skew its time)
        if not world.standby and not plan.bench and _running_for(collector) > _standby_after(plan):
            world.standby.append(world.pool.standby(world.world_size, plan.settings.launch))
        time.sleep(POLL_SECONDS)
    return _Ending()


def _after_launch(world: _World, launch: Launch, collector: Collector, ending: _Ending) -> list[Item]:
    """The launch's end: given back when every item finished; else ended, with the item in flight (hung, or on a
    dead rank) turned into error rows and the rest left to run (less the hang budget's skips)."""
    watchdog_reason = ending.watchdog_reason
    deaths = {} if watchdog_reason else launch.deaths()  # before our own kill adds to them
    # The watch may end on a death before it read the events that came with it: the item in flight (whose stacks and
    # dead ranks' words are taken now) must be known from them.
    world.progress.done(collector.poll())
    in_flight = collector.in_flight()
    evidence = None
    if in_flight is not None and not collector.all_finished():  # every live rank's stack, before the kill
        evidence = postmortem.take(launch, in_flight, launch.plans_given - 1, deaths, world.writer.path.parent)
    elif watchdog_reason and not collector.finished:  # stuck before the first item: where each rank was
        watchdog_reason += postmortem.startup_stacks(launch)
    if collector.all_finished() and not deaths:
        if world.plan.profile:  # the ranks write their profiles as they exit
            launch.stop(wait=60)
        else:
            world.pool.give_back(launch)
        world.progress.done(collector.poll())
        return []
    launch.kill()
    world.progress.done(collector.poll())
    unfinished = collector.unfinished()
    if not unfinished:
        return []
    failed = collector.in_flight() or unfinished[0]
    if not collector.state[failed.id].started and not collector.finished:
        _launch_failed(world, launch, collector, unfinished, watchdog_reason, deaths)
        return []
    if ending.hung and not watchdog_reason and not collector.state[failed.id].stuck:
        watchdog_reason = (
            f"no rank finished the case within --timeout {world.plan.timeout:g}s: "
            "the driver took the ranks' stacks and ended them"
        )
    cause = collector.abort(failed, watchdog_reason, deaths=deaths, evidence=evidence if failed is in_flight else None)
    world.progress.done([failed])
    remaining = [i for i in unfinished if i.id != failed.id]
    mesh_failed = Phase.MESH in collector.state[failed.id].phase.values()  # every item at the topology would end so
    return (
        _skip_after(world, collector, failed, cause, remaining, mesh_failed)
        if mesh_failed or world.hang_budget
        else remaining
    )


def _launch_failed(
    world: _World, launch: Launch, collector: Collector, unfinished: list[Item], watchdog_reason: str, deaths: dict
) -> None:
    """The launch died before running anything: every remaining item is an error, saying why."""
    codes = ", ".join(f"rank {r}: {w}" for r, w in sorted(deaths.items()))
    why = (
        watchdog_reason
        or _error_lines(launch.log_text())
        or (f"workers exited ({codes})" if codes else "workers exited")
    )
    for item in unfinished:
        collector.abort(item, f"worker launch failed: {why} (logs: {launch.dir}/rank*.log)")
        world.progress.done([item])


def _skip_after(
    world: _World, collector: Collector, failed: Item, cause: str, remaining: list[Item], mesh_failed: bool
) -> list[Item]:
    """The items `failed`'s ending makes pointless, skipped; the items still to run.  The hang budget: the failed
    op's other items at its topology (one timeout per topology, not one per item).  A mesh that was not built
    (`mesh_failed`): the topology's other items, of every op, each of which would end the same way on a launch of its
    own (seconds apiece for CUDA ranks)."""
    if mesh_failed:
        reason = (
            f"skipped: the device mesh of {failed.full_topology} was not built ({failed.op} {cause} in case "
            f"{failed.case_id} {failed.dtype}); no item at this topology can run"
        )
    else:
        reason = (
            f"skipped: {failed.op} {cause} in case {failed.case_id} {failed.dtype} at {failed.full_topology}; "
            f"its other items at this topology are not run (--no-hang-budget runs them)"
        )
    for item in remaining:  # the whole topology: a hang at dp4-ep2 does not skip dp4's items
        if item.full_topology == failed.full_topology and (mesh_failed or item.op == failed.op):
            collector.skip(item, reason)
            world.progress.done([item])
    return [i for i in remaining if i.id not in collector.finished]
