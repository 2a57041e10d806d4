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

import cProfile
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import groupby
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from shardcheck.harness.core.plan_data import Item, Plan
from shardcheck.harness.core.records import RecordWriter
from shardcheck.harness.driver import postmortem
from shardcheck.harness.driver.collect import Collector
from shardcheck.harness.driver.last_words import EXCEPTION_LINE
from shardcheck.harness.driver.pool import Launch, LaunchSettings, WorkerPool
from shardcheck.harness.rank.artefacts import ArtefactBudget

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
    show_progress: bool,
    hang_budget: bool = True,
    artefacts: ArtefactBudget | None = None,
    pool: WorkerPool | None = None,
) -> None:
    """Run every item of `plan`, one launch per world size (more after a hang or death); rows go to `writer`.
    With a `pool`, launches come from it and go back to it when every item finished; without one, they end here."""
    if pool is None:
        with WorkerPool(run_dir) as own:
            return run_plan(plan, run_dir, writer, show_progress, hang_budget, artefacts, own)
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
        # Items the planner found the case cannot lay out at their topology: recorded `skip` with its reason, and
        # no launch started for them.
        skipped = [i for i in plan.items if i.skip]
        if skipped:
            collector = Collector(plan, skipped, run_dir, writer, 0, artefacts)
            for item in skipped:
                collector.skip(item, item.skip)
            progress.update(task, advance=len(skipped))
        worlds = [
            (w, list(items))
            for w, items in groupby(
                sorted((i for i in plan.items if not i.skip), key=lambda i: (i.world_size, i.id)),
                key=lambda i: i.world_size,
            )
        ]
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


def _run_world(
    plan: Plan,
    items: list[Item],
    world_size: int,
    run_dir: Path,
    writer: RecordWriter,
    progress: Progress,
    task,
    hang_budget: bool,
    artefacts: ArtefactBudget,
    stop: threading.Event,
    pool: WorkerPool,
) -> None:
    standby: list[Launch] = []  # at most one launch started ahead for the next attempt
    # --profile: cProfile follows one thread; a launch thread beside the main one keeps its own profile, which the
    # breakdown merges with the driver's (reports/profile.py)
    profiler = _thread_profiler(plan)
    try:
        _run_launches(plan, items, world_size, writer, progress, task, hang_budget, artefacts, standby, stop, pool)
    except _Stopped:
        pass  # another launch thread ended the run; its exception is the one raised
    finally:
        for launch in standby:  # started ahead but never needed
            launch.discard()
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(Path(plan.profile) / f"driver-launch-w{world_size}.prof")


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


def _run_launches(
    plan: Plan,
    items: list[Item],
    world_size: int,
    writer: RecordWriter,
    progress: Progress,
    task,
    hang_budget: bool,
    artefacts: ArtefactBudget,
    standby: list[Launch],
    stop: threading.Event,
    pool: WorkerPool,
) -> None:
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
        events_dir, started = launch.give_plan(
            Plan(**{**plan.__dict__, "items": remaining, "failure_artefacts": artefacts.left})
        )
        events_dir.mkdir(parents=True, exist_ok=True)
        collector = Collector(plan, remaining, events_dir, writer, world_size, artefacts)
        watchdog_reason = ""
        hung = False
        try:
            while not launch.ended():
                if stop.is_set():
                    raise _Stopped
                for item in collector.poll():
                    progress.update(
                        task,
                        advance=1,
                        description=f"{item.op.split('.', 1)[1]} {item.dtype} "
                        f"dp{item.topology[0]}cp{item.topology[1]}tp{item.topology[2]}",
                    )
                if collector.all_finished():  # every rank reported every item
                    break
                hung = _hung(collector, plan.timeout)
                if hung:
                    break
                quiet = time.time() - max(collector.last_event, started)
                if quiet > plan.timeout + _watchdog_grace(plan, collector):
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
        # The loop may end on a death before it read the events that came with it: the item in flight (whose
        # stacks and dead ranks' words are taken now) must be known from them.
        for item in collector.poll():
            progress.update(task, advance=1)
        in_flight = collector.in_flight()
        evidence = None
        if in_flight is not None and not collector.all_finished():  # every live rank's stack, before the kill
            evidence = postmortem.take(launch, in_flight, launch.plans_given - 1, deaths, writer.path.parent)
        elif watchdog_reason and not collector.finished:  # stuck before the first item: where each rank was
            watchdog_reason += postmortem.startup_stacks(launch)
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
        log_text = launch.log_text()
        failed = collector.in_flight() or unfinished[0]
        if not collector.state[failed.id].started and not collector.finished:
            # The launch died before running anything: every remaining item is an error.
            codes = ", ".join(f"rank {r}: {w}" for r, w in sorted(deaths.items()))
            why = (
                watchdog_reason
                or _error_lines(log_text)
                or (f"workers exited ({codes})" if codes else "workers exited")
            )
            for item in unfinished:
                collector.abort(item, f"worker launch failed: {why} (logs: {launch.dir}/rank*.log)")
                progress.update(task, advance=1)
            return
        if hung and not watchdog_reason and not collector.state[failed.id].stuck:
            watchdog_reason = (
                f"no rank finished the case within --timeout {plan.timeout:g}s: "
                "the driver took the ranks' stacks and ended them"
            )
        cause = collector.abort(
            failed, watchdog_reason, deaths=deaths, evidence=evidence if failed is in_flight else None
        )
        progress.update(task, advance=1)
        remaining = [i for i in unfinished if i.id != failed.id]
        if hang_budget:
            dp, cp, tp = failed.topology
            reason = (
                f"skipped: {failed.op} {cause} in case {failed.case_id} {failed.dtype} at dp{dp}-cp{cp}-tp{tp}; "
                f"its other items at this topology are not run (--no-hang-budget runs them)"
            )
            for item in remaining:
                if (item.op, item.topology) == (failed.op, failed.topology):
                    collector.skip(item, reason)
                    progress.update(task, advance=1)
            remaining = [i for i in remaining if i.id not in collector.finished]
