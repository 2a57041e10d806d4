"""A WorkerPool keeps a launch's ranks between plans (what `shardcheck fuzz` runs its examples on): the same
processes serve plan after plan, item ids restart per plan without mixing their check-ins, and a plan whose op
hangs ends the launch, the next plan getting a fresh one."""

from __future__ import annotations

import dataclasses
import re
import signal
import socket
import subprocess
import sys
import threading

from shardcheck.harness.core.options import LaunchSettings, RunSettings
from shardcheck.harness.core.records import RecordWriter, load
from shardcheck.harness.core.topology import Topology
from shardcheck.harness.driver.launch import WorkerPool, run_plan
from shardcheck.harness.driver.planner import Selection, build_plan
from shardcheck.harness.driver.pool import Launch
from shardcheck.harness.rank import worker
from tests.helpers import FIXTURES

TP2 = [Topology(1, 1, 2)]


def _plan(op: str, cases: list[str], impl: dict | None = None, timeout: float = 60.0):
    return build_plan(
        Selection(
            run_id="pool",
            suites_wanted=["model_utils"],
            ops=[op],
            case_patterns=cases,
            world_sizes=None,
            topologies=TP2,
            dtypes=["float64"],
            impl=dict(impl or {}),
            quick=True,
            settings=RunSettings(device="cpu", backend="gloo", timeout=timeout, seed=0),
        )
    )


def _statuses(run_dir) -> dict[str, set[str]]:
    rows = load(run_dir)
    return rows.groupby("case_id")["status"].agg(set).to_dict()


def test_pool_serves_plan_after_plan_on_the_same_ranks(tmp_path):
    """Plans of different --timeout too: the ranks read it from each plan (RunSettings), not from their launch."""
    first = _plan("model_utils.DistributedLogprob", ["*"])
    second = _plan("model_utils.DistributedCrossEntropy", ["*"], timeout=30.0)
    with WorkerPool(tmp_path / "run") as pool:
        writer = RecordWriter(tmp_path / "run")
        run_plan(first, tmp_path / "run", writer, show_progress=False, pool=pool)
        launch = pool.idle[2, first.settings.launch]
        pids = [p.pid for p in launch.procs]
        run_plan(second, tmp_path / "run", writer, show_progress=False, pool=pool)
        assert pool.idle[2, second.settings.launch] is launch and [p.pid for p in launch.procs] == pids
        assert not launch.ended()
        writer.close()
    assert launch.ended()  # leaving the pool ends its ranks
    rows = load(tmp_path / "run")
    assert set(rows["op"]) == {"model_utils.DistributedLogprob", "model_utils.DistributedCrossEntropy"}
    assert (rows["status"] == "pass").all(), rows[rows["status"] != "pass"]
    # both plans' items (ids from 0 in each), a row for every check of every item
    events = tmp_path / "run" / "workers" / "w2-launch0"
    assert sorted(p.name for p in events.glob("plan*") if p.is_dir()) == ["plan0", "plan1"]
    assert len(rows) == sum(len(i.checks) for p in (first, second) for i in p.items)


def test_a_hang_ends_the_launch_and_the_next_plan_gets_a_fresh_one(tmp_path):
    skips = {"model_utils": str(FIXTURES / "model_utils" / "skips_collective.py")}
    hanging = _plan("model_utils.DistributedLogprob", ["*"], impl=skips, timeout=3)
    clean = _plan("model_utils.DistributedLogprob", ["*"], timeout=3)
    with WorkerPool(tmp_path / "run") as pool:
        writer = RecordWriter(tmp_path / "hang")
        run_plan(hanging, tmp_path / "run", writer, show_progress=False, pool=pool)
        writer.close()
        hung = pool.idle.get((2, hanging.settings.launch))
        writer = RecordWriter(tmp_path / "clean")
        run_plan(clean, tmp_path / "run", writer, show_progress=False, pool=pool)
        writer.close()
        assert pool.idle[2, clean.settings.launch] is not hung
    hang_rows = load(tmp_path / "hang")
    assert set(hang_rows["status"]) == {"error", "skip"}  # the first item hangs, the op's others are skipped
    assert (load(tmp_path / "clean")["status"] == "pass").all()


class _FakeLaunch:
    """A launch without processes: what the pool's bookkeeping needs."""

    def __init__(self, launch_dir, world_size, settings):
        self.world_size, self.settings, self.discarded = world_size, settings, False

    def ended(self) -> bool:
        return self.discarded

    def discard(self) -> None:
        self.discarded = True


def test_pool_keeps_a_launch_per_settings_and_at_most_max_idle_ranks(tmp_path, monkeypatch):
    """Runs of a shared pool differ in launch settings (a test's --no-shims): each keeps its launch; past
    MAX_IDLE_RANKS the least recently given back goes."""
    from shardcheck.harness.driver import pool as workers

    monkeypatch.setattr(workers, "Launch", _FakeLaunch)
    monkeypatch.setattr(workers, "MAX_IDLE_RANKS", 8)
    shimmed, bare = LaunchSettings("cpu", "gloo", shims=True), LaunchSettings("cpu", "gloo", shims=False)
    pool = workers.WorkerPool(tmp_path)
    a, b = pool.take(4, shimmed), pool.take(4, bare)
    assert a is not b
    pool.give_back(a)
    pool.give_back(b)
    assert pool.take(4, shimmed) is a and not b.discarded  # each settings its own idle launch
    pool.give_back(a)
    c = pool.take(2, bare)
    pool.give_back(c)  # 4 + 4 + 2 ranks idle > 8: b (given back before a) goes
    assert b.discarded and not a.discarded and not c.discarded
    assert set(pool.idle) == {(4, shimmed), (2, bare)}
    pool.close()
    assert a.discarded and c.discarded and not pool.idle


def test_ranks_that_fail_to_start_are_named_with_their_error_from_the_log(tmp_path):
    """Forked ranks write their output to the launch's rank<R>.log and their pid to rank<R>.pid; a launch whose ranks
    fail before the first item turns every item into an error quoting the log's last error line.  (The first rank to
    fail may end the launch before the other is forked: that one has no log, having never run.)"""
    plan = _plan("model_utils.DistributedLogprob", ["b2s5*"])
    plan.settings = dataclasses.replace(plan.settings, backend="no_such_backend")  # init_process_group raises
    with WorkerPool(tmp_path / "run") as pool:
        writer = RecordWriter(tmp_path / "run")
        run_plan(plan, tmp_path / "run", writer, show_progress=False, pool=pool)
        writer.close()
    launch_dir = tmp_path / "run" / "workers" / "w2-launch0"
    started = sorted(launch_dir.glob("rank*.log"))  # a log per rank that was forked
    assert {p.name for p in started} <= {"rank0.log", "rank1.log"} and started, started
    failed = [p for p in started if "no_such_backend" in p.read_text()]
    assert failed, [p.read_text() for p in started]
    assert all(p.with_suffix(".pid").read_text().isdigit() for p in failed)  # (written before the rendezvous)
    rows = load(tmp_path / "run")
    assert len(rows) == sum(len(i.checks) for i in plan.items) and (rows["status"] == "error").all()
    assert rows["message"].str.contains("worker launch failed: .*no_such_backend", regex=True).all(), rows[
        "message"
    ].tolist()
    assert rows["message"].str.contains(r"exit code 1|rank\*\.log", regex=True).all()


def test_a_rank_killed_before_it_leads_a_session_of_its_own_is_ended(tmp_path):
    """A launch ended while a rank is just forked (not yet a session leader: killing its session finds none, as
    when rank 0 dies before rank 1 ran its first line) ends that rank too, not waiting for it for ever."""
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # in the test's own session
    launch = Launch.__new__(Launch)
    launch.procs, launch.killed = [rank], False
    ender = threading.Thread(target=launch.kill, daemon=True)
    ender.start()
    ender.join(timeout=20)
    assert not ender.is_alive() and rank.returncode == -signal.SIGKILL


def test_a_rank_whose_rank_0_died_after_writing_the_port_gives_up_at_the_connect_bound(tmp_path, monkeypatch):
    """Rank 1 connecting to the store of a rank 0 that died after writing its port (its init_process_group raised)
    fails at STORE_CONNECT_WAIT, not after PEER_WAIT: its launch ends and the driver names rank 0's error."""
    with socket.socket() as sock:  # a port nobody listens on any more
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    (tmp_path / "store-port").write_text(str(port))
    monkeypatch.setattr(worker, "STORE_CONNECT_WAIT", 3.0)
    raised: list[BaseException] = []

    def connect() -> None:
        try:
            worker._rendezvous(tmp_path, rank=1, world=2)
        except Exception as exc:
            raised.append(exc)

    rank = threading.Thread(target=connect, daemon=True)  # (a connect that retries for ever blocks in C++)
    rank.start()
    rank.join(timeout=60)
    assert not rank.is_alive() and len(raised) == 1, raised
    assert re.search("(?i)timed? ?out|connect", str(raised[0])), raised[0]
