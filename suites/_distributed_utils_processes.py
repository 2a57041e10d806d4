"""distributed_utils suite: the process-level ops' scenarios, run on fresh ranks
(shardcheck.harness.core.processes.run_ranks), and the properties judged from what the ranks did (exit codes, return
values, ordered events, log records).

Each scenario loads the module under test by reference in its rank, so the ops may use the default (world)
group, abort the job or block without touching the worker.  A rank still running after PROCESS_DEADLINE_S is
killed and reported.
"""

from __future__ import annotations

import builtins
import re
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from shardcheck import Property
from shardcheck.harness.core.peer_failure import is_peer_failure
from shardcheck.harness.core.processes import RAISED_AT, ProcessRun, RankOutcome, RankProcess, load_module

PROCESS_DEADLINE_S = 20.0  # a fresh rank still running then is killed: a hang costs this much
BARRIER_TIMEOUT_S = 1.0  # the timeout a late rank misses
ON_TIME_TIMEOUT_S = 5.0  # for barriers every rank reaches at once: returns as soon as they have
SLACK_S = 2.0  # scheduling slack on a loaded machine, on top of a timeout
BLOCK_S = 0.2  # time a rank spends inside a FirstRankPerNode block
STAGGER_S = 0.3  # rank r arrives at barrier_and_log r·STAGGER_S late
SUBGROUP = [0, 1]  # the group of the subgroup barrier case; its world has one rank more
FAILURE = "failure inside"  # the words of the exception a FirstRankPerNode block raises


# ---- scenarios --------------------------------------------------------------------------------


def first_rank_scenario(proc: RankProcess, impl_ref: str, raising_rank: int) -> bool:
    impl = load_module(impl_ref)
    with impl.FirstRankPerNode() as first:
        proc.event("enter", first=first)
        if proc.rank == raising_rank:
            raise RuntimeError(f"{FAILURE} the FirstRankPerNode block on rank {proc.rank}")
        time.sleep(BLOCK_S)
        proc.event("leave")
    proc.event("after", process_group=dist.is_initialized())
    return first


def late_rank_scenario(proc: RankProcess, impl_ref: str) -> dict:
    impl = load_module(impl_ref)
    late = proc.world_size - 1
    gloo = impl._create_gloo_group()
    dist.barrier()  # everyone here: the next barrier is reached on time

    def timed_barrier(step: str, timeout: float, group=None) -> bool:
        proc.event(f"call:{step}")
        try:
            value = impl._barrier_with_timeout(timedelta(seconds=timeout), group=group)
        except BaseException as exc:
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            proc.event(f"return:{step}", error=f"{type(exc).__name__}: {first_line}"[:200])
            raise
        proc.event(f"return:{step}", value=value)
        return value

    timed_barrier("on-time", ON_TIME_TIMEOUT_S)
    if proc.rank == late:  # arrive only once every other rank has given up (or the run's deadline)
        proc.wait_for("return:late", [r for r in range(proc.world_size) if r != late], PROCESS_DEADLINE_S)
    timed_barrier("late", BARRIER_TIMEOUT_S)
    # The groups still work: a collective on the default group and on the gloo group, another barrier.
    world_sum = torch.tensor([proc.rank + 1.0])
    dist.all_reduce(world_sum)
    gloo_sum = torch.tensor([proc.rank + 1.0])
    dist.all_reduce(gloo_sum, group=gloo)
    again = timed_barrier("after", ON_TIME_TIMEOUT_S, group=gloo)
    return {"world_sum": world_sum.item(), "gloo_sum": gloo_sum.item(), "barrier_after": again}


def subgroup_barrier_scenario(proc: RankProcess, impl_ref: str) -> None:
    """A barrier on a group of ranks 0 and 1 (every rank creates it, as new_group requires); only its members call
    the op, as a model-local group's caller does: rank 2 has no part in it and goes on."""
    impl = load_module(impl_ref)
    group = dist.new_group(ranks=SUBGROUP, backend="gloo")
    dist.barrier()  # everyone here: the group exists, its members reach the barrier on time
    if proc.rank not in SUBGROUP:
        return
    proc.event("call:group")
    proc.event("return:group", value=impl._barrier_with_timeout(timedelta(seconds=ON_TIME_TIMEOUT_S), group=group))


def gloo_group_scenario(proc: RankProcess, impl_ref: str) -> dict:
    impl = load_module(impl_ref)
    group = impl._create_gloo_group()
    if group is None:
        return {"group": None}
    dist.monitored_barrier(group=group, timeout=timedelta(seconds=ON_TIME_TIMEOUT_S))
    total = torch.tensor([proc.rank + 1.0])
    dist.all_reduce(total, group=group)
    return {
        "group": type(group).__name__,
        "ranks": dist.get_process_group_ranks(group),
        "backend": str(dist.get_backend(group)),
        "sum": total.item(),
    }


LOG_MESSAGE = "shardcheck: barrier_and_log after every rank arrived"


def barrier_log_scenario(proc: RankProcess, impl_ref: str) -> None:
    impl = load_module(impl_ref)
    if dist.is_initialized():
        dist.barrier()  # start together, then arrive staggered
    time.sleep(STAGGER_S * proc.rank)
    proc.event("arrive")
    impl.barrier_and_log(LOG_MESSAGE)
    proc.event("return")


# ---- a rank's own exception where the case raises nothing -------------------------------------


_FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line (?P<line>\d+)', re.MULTILINE)


def raise_what_a_rank_raised(run: ProcessRun, impl_file: str | None) -> ProcessRun:
    """`run` where no rank's block is meant to raise; else the first rank's own exception (not a peer's closed
    connection, a kill or a bare death) raised here as the case's error, at its line in the module under test: a
    line of its own in the findings, split by its message, where the properties it made fail would fold two such
    raises into one line (issue 42: a pre-fix FirstRankPerNode that cannot create its group, in a job and in a
    single process)."""
    origin = run.origin()
    if origin is None or not origin.error or not origin.traceback or is_peer_failure(origin.error):
        return run
    name, _, message = origin.error.partition(": ")
    frames = [(m["file"], int(m["line"])) for m in _FRAME.finditer(origin.traceback)]
    ours = [f for f in frames if impl_file and Path(f[0]).resolve() == Path(impl_file).resolve()]
    where = (ours or frames or [("<rank>", 1)])[-1]
    error_type = getattr(builtins, name, None)
    if not (isinstance(error_type, type) and issubclass(error_type, Exception)):
        error_type = type(name, (Exception,), {})  # a type of the module under test's: its name is what we show
    error = error_type(f"{message} [fresh rank {origin.rank} of {len(run.ranks)}]")
    setattr(error, RAISED_AT, where)  # the error row names where the rank raised, not this line
    raise error


# ---- properties -------------------------------------------------------------------------------


def ranks_ended_cleanly(run: ProcessRun) -> Property:
    """Every rank exited 0 by itself; the value recorded is the ranks' wall time (a hang: the deadline)."""
    bad = [r for r in run.ranks if r.killed or r.exitcode != 0]
    return Property(
        "ranks_end",
        not bad,
        run.wall_s,
        f"every rank exited 0 in {run.wall_s:.1f}s"
        if not bad
        else f"deadline {run.deadline_s:g}s: " + "; ".join(r.describe() for r in bad),
    )


def judge_first_rank_order(run: ProcessRun) -> list[Property]:
    returned_ok, order_bad = [], []
    for r in run.ranks:
        want = r.local_rank == 0
        if not (r.returned and r.result is want):
            returned_ok.append(
                f"rank {r.rank} (node {r.node}, local rank {r.local_rank}): "
                f"{'got ' + repr(r.result) if r.returned else 'no result'}, expected {want}"
            )
    for node in range(run.nodes):
        ranks = [r for r in run.ranks if r.node == node]
        first = next(r for r in ranks if r.local_rank == 0)
        left = first.event("leave")
        for r in ranks:
            if r is first:
                continue
            entered = r.event("enter")
            if left is None or entered is None or entered.seq < left.seq:
                order_bad.append(
                    f"node {node}: rank {r.rank} entered "
                    f"{'(never)' if entered is None else f'at #{entered.seq}'} before its first rank "
                    f"{first.rank} left {'(never)' if left is None else f'at #{left.seq}'}"
                )
    order = " ".join(f"{e.name}:{e.rank}" for e in run.events() if e.name in ("enter", "leave"))
    still_initialized = [r.rank for r in run.ranks if (r.event("after") and r.event("after").data.get("process_group"))]
    return [
        ranks_ended_cleanly(run),
        Property(
            "first_rank_per_node_true",
            not returned_ok,
            None,
            "; ".join(returned_ok) if returned_ok else "True on local rank 0 of each node, False elsewhere",
        ),
        Property(
            "others_enter_after_first_left",
            not order_bad,
            None,
            ("; ".join(order_bad) + f" (order: {order})") if order_bad else f"order: {order}",
        ),
        Property(
            "own_process_group_destroyed",
            not still_initialized,
            None,
            f"process group still initialised after the block on rank(s) {still_initialized}"
            if still_initialized
            else "the process group it created is gone after the block",
        ),
    ]


def _logged_error(r: RankOutcome) -> str | None:
    """The first error this rank logged that names the block's exception: an op that ends the job with a bare
    SystemExit after logging the exception (upstream's fix of its `quit(1)`) still names what failed."""
    return next((rec.message for rec in r.logs if rec.level in ("ERROR", "CRITICAL") and FAILURE in rec.message), None)


def judge_first_rank_raise(run: ProcessRun, raising_rank: int) -> list[Property]:
    survivors = [r for r in run.ranks if r.killed or r.exitcode == 0]
    origin = run.origin()
    logged = _logged_error(origin) if origin is not None else None
    named = origin is not None and origin.rank == raising_rank and (FAILURE in (origin.error or "") or bool(logged))
    went_on = [r.rank for r in run.ranks if r.event("after") is not None]
    return [
        Property(
            "exception_ends_every_rank",
            not survivors and not went_on,
            run.wall_s,
            (
                f"every rank ended non-zero within {run.wall_s:.1f}s: "
                if not survivors
                else f"not every rank ended non-zero by itself (deadline {run.deadline_s:g}s): "
            )
            + run.describe()
            + (f"; rank(s) {went_on} carried on after the block" if went_on else ""),
        ),
        Property(
            "error_names_rank",
            named,
            None,
            f"origin: {origin.describe() if origin else 'none'}"
            + (f", logged {logged!r}" if logged else ", nothing logged")
            + f" (expected rank {raising_rank}'s RuntimeError)",
        ),
    ]


def judge_no_distributed(run: ProcessRun) -> list[Property]:
    r = run.ranks[0]
    ok = r.exitcode == 0 and r.result is True and r.event("leave") is not None
    return [Property("single_process_true", ok, None, r.describe())]


def elapsed(r: RankOutcome, step: str) -> tuple[float | None, object]:
    call, ret = r.event(f"call:{step}"), r.event(f"return:{step}")
    if call is None or ret is None:
        return None, "never returned" if call is not None else "never called"
    return ret.time - call.time, ret.data.get("value", ret.data.get("error"))


def judge_late_rank(run: ProcessRun) -> list[Property]:
    late = run.world_size - 1
    on_time, waited, late_bad, after_bad = [], [], [], []
    for r in run.ranks:
        _, value = elapsed(r, "on-time")
        if value is not True:
            on_time.append(f"rank {r.rank}: {value!r}")
        took, value = elapsed(r, "late")
        if r.rank == late:
            if value is not False or took is None or took > BARRIER_TIMEOUT_S + SLACK_S:
                late_bad.append(f"rank {r.rank}: {value!r}" + (f" after {took:.2f}s" if took is not None else ""))
        elif value is not False or took is None or not BARRIER_TIMEOUT_S - 0.05 <= took <= BARRIER_TIMEOUT_S + SLACK_S:
            waited.append(f"rank {r.rank}: {value!r}" + (f" after {took:.2f}s" if took is not None else ""))
        want = float(sum(range(1, run.world_size + 1)))
        res = r.result if r.returned else None
        if res is None or res["world_sum"] != want or res["gloo_sum"] != want or res["barrier_after"] is not True:
            after_bad.append(f"rank {r.rank}: {res if res is not None else (r.error or 'no result')}")
    took = [f"{elapsed(r, 'late')[0]:.2f}s" for r in run.ranks if r.rank != late and elapsed(r, "late")[0] is not None]
    killed = "; ".join(r.describe() for r in run.ranks if r.killed)
    suffix = f" ({killed})" if killed else ""
    return [
        ranks_ended_cleanly(run),
        Property("on_time_true", not on_time, None, "; ".join(on_time) + suffix if on_time else "True on every rank"),
        Property(
            "waiting_ranks_false_within_timeout",
            not waited,
            None,
            (f"expected False after {BARRIER_TIMEOUT_S:g}s (+ {SLACK_S:g}s slack): " + "; ".join(waited) + suffix)
            if waited
            else f"False after {', '.join(took)} (timeout {BARRIER_TIMEOUT_S:g}s)",
        ),
        Property(
            "late_rank_false",
            not late_bad,
            None,
            ("; ".join(late_bad) + suffix) if late_bad else f"rank {late}, arriving after the others gave up: False",
        ),
        Property(
            "groups_work_after",
            not after_bad,
            None,
            ("; ".join(after_bad) + suffix)
            if after_bad
            else "all-reduce on the default and the gloo group right, and a barrier on the gloo group True",
        ),
    ]


def judge_subgroup_barrier(run: ProcessRun) -> list[Property]:
    """One property: the scenario's only step is the barrier, so a member that hangs in it (killed at the deadline)
    and one that returns anything but True are the same failure; rank 2 only has to end."""
    bad = []
    for r in run.ranks:
        took, value = elapsed(r, "group")
        if r.rank in SUBGROUP and (value is not True or took > ON_TIME_TIMEOUT_S + SLACK_S):
            bad.append(f"rank {r.rank}: {value!r}" + (f" after {took:.2f}s" if took is not None else ""))
        if r.killed or r.exitcode != 0:
            bad.append(r.describe())
    return [
        Property(
            "group_members_true",
            not bad,
            run.wall_s,
            "; ".join(bad) + (f" (deadline {run.deadline_s:g}s)" if any(r.killed for r in run.ranks) else "")
            if bad
            else f"True on ranks {SUBGROUP} (the group's), rank {run.world_size - 1} not taking part, every rank ended",
        )
    ]


def judge_gloo_group(runs: dict[str, ProcessRun]) -> list[Property]:
    world = runs["world"]
    want = {
        "group": "ProcessGroup",
        "ranks": list(range(world.world_size)),
        "backend": "gloo",
        "sum": float(sum(range(1, world.world_size + 1))),
    }
    bad = [
        f"rank {r.rank}: {r.result if r.returned else r.error}"
        for r in world.ranks
        if not (r.returned and r.result == want)
    ]
    single = runs["single"].ranks[0]
    return [
        ranks_ended_cleanly(world),
        Property(
            "gloo_group_over_all_ranks",
            not bad,
            None,
            "; ".join(bad) if bad else f"a gloo group of ranks {want['ranks']}: monitored_barrier and all-reduce work",
        ),
        Property(
            "none_without_distributed", single.returned and single.result == {"group": None}, None, single.describe()
        ),
    ]


def judge_barrier_log(runs: dict[str, ProcessRun]) -> list[Property]:
    run = runs["world"]
    records = [rec for rec in run.logs if LOG_MESSAGE in rec.message]
    arrivals = run.events("arrive")
    last_arrival = max((e.seq for e in arrivals), default=None)
    one = len(records) == 1 and records[0].rank == 0
    after = bool(records) and len(arrivals) == run.world_size and all(rec.seq > last_arrival for rec in records)
    returns = run.events("return")
    waited = len(returns) == run.world_size and all(e.seq > last_arrival for e in returns)
    single = [rec for rec in runs["single"].logs if LOG_MESSAGE in rec.message]
    where = ", ".join(f"rank {rec.rank} (#{rec.seq})" for rec in records) or "none"
    return [
        ranks_ended_cleanly(run),
        Property("one_record_from_rank_0", one, None, f"records with the message: {where}"),
        Property(
            "logged_after_every_rank_arrived",
            after,
            None,
            f"records {where}; last arrival #{last_arrival} ({len(arrivals)} of {run.world_size} ranks arrived)",
        ),
        Property(
            "every_rank_waits",
            waited,
            None,
            "returns " + " ".join(f"{e.rank}:#{e.seq}" for e in returns) + f"; last arrival #{last_arrival}",
        ),
        Property(
            "single_process_logs_once", len(single) == 1, None, f"{len(single)} record(s) without torch.distributed"
        ),
    ]
