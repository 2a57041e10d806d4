"""The CI gate: a hanging op costs one timeout per topology (hang budget), a killed rank is named
with its signal, and the run writes JUnit XML and the GitHub step summary."""

from __future__ import annotations

import os
import signal
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from helpers import FIXTURES, ROOT, shardcheck

SKIPS_COLLECTIVE = ("--impl", f"model_utils={FIXTURES / 'model_utils' / 'skips_collective.py'}")
FLOAT64_QUICK = ("--dtype", "float64", "--quick")


def test_hanging_op_costs_one_timeout_per_topology(tmp_path, monkeypatch):
    summary = tmp_path / "step_summary.md"
    summary.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    junit = tmp_path / "junit.xml"
    started = time.time()
    # world size 2: tp1 and dp2 pass (no TP peer to skip), tp2 hangs in its first of 3 quick cases
    run = shardcheck(
        "run",
        *SKIPS_COLLECTIVE,
        "--op",
        "model_utils.DistributedLogprob",
        "--world-sizes",
        "2",
        *FLOAT64_QUICK,
        "--timeout",
        "5",
        "--junit-xml",
        str(junit),
        out=tmp_path / "run",
        timeout=300,
        fresh=True,
    )  # (its launches counted in its own folder)
    elapsed = time.time() - started
    assert run.returncode == 1, run.stdout + run.stderr
    rows = run.rows
    tp2 = rows[rows["tp"] == 2]
    items = tp2.groupby("case_id")["status"].agg(set)
    assert sorted(map(sorted, items)) == [["error"], ["skip"], ["skip"]]
    hung_case = items[items == {"error"}].index[0]
    skipped = tp2[tp2["status"] == "skip"]
    assert (
        skipped["message"]
        .str.startswith(f"skipped: model_utils.DistributedLogprob hung in case {hung_case} float64 at dp1-cp1-tp2")
        .all()
    )
    forward_tp1 = rows[(rows["tp"] == 1) & (rows["check"] == "forward")]  # (this impl has no backward at all)
    assert len(forward_tp1) == 3 and (forward_tp1["status"] == "pass").all()  # dp2 ran every item
    # one timeout and one relaunch, not three of each (wall clock: loose, launches are slow on a loaded machine)
    assert sorted(p.name for p in (run.out / "workers").iterdir()) == ["w2-launch0", "w2-launch1"]
    assert elapsed < 300, elapsed
    assert ", 5 skipped -> " in run.stdout  # the summary counts the skipped checks
    # JUnit: one testcase per item, the hang an error, the skipped items skipped
    root = ET.parse(junit).getroot()
    cases = root.findall(".//testcase")
    n_items = rows.groupby(["case_id", "dp", "cp", "tp", "dtype"]).ngroups
    assert len(cases) == n_items == int(root.get("tests"))
    assert (root.get("errors"), root.get("failures"), root.get("skipped")) == ("3", "0", "2")  # + 2 missing backwards
    error = root.find(f".//testcase[@name='{hung_case} [dp1-cp1-tp2 float64]']/error")
    assert "did not finish the case within" in error.get("message") and "rerun: shardcheck run" in error.text
    names = {c.get("name") for c in cases}
    assert f"{hung_case} [dp1-cp1-tp2 float64]" in names
    assert all(
        s.get("message").startswith("skipped: model_utils.DistributedLogprob hung") for s in root.iter("skipped")
    )
    # the GitHub step summary is appended to, not overwritten
    text = summary.read_text()
    assert text.startswith("earlier step\n") and "shardcheck run" in text and "5 skip" in text
    assert f"rerun: shardcheck run --suite model_utils --op model_utils.DistributedLogprob --case {hung_case}" in text


def test_no_hang_budget_tries_every_item(tmp_path):
    run = shardcheck(
        "run",
        *SKIPS_COLLECTIVE,
        "--op",
        "model_utils.DistributedLogprob",
        "--topology",
        "tp=2",
        "--case",
        "b4s6v37-masked0.3",
        "--case",
        "b2s5*",
        *FLOAT64_QUICK,
        "--timeout",
        "5",
        "--no-hang-budget",
        out=tmp_path / "run",
        timeout=300,
        fresh=True,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    rows = run.rows
    assert set(rows["status"]) == {"error"} and rows["case_id"].nunique() == 2
    assert len(list((run.out / "workers").iterdir())) == 2  # the second case hung in the relaunch


def _worker_pid(out: Path, rank: int) -> int | None:
    """The pid of the worker of `rank` in the first launch of world size 2 of the run writing to `out`."""
    pid_file = out / "workers" / "w2-launch0" / f"rank{rank}.pid"
    return int(pid_file.read_text()) if pid_file.is_file() else None


def test_killed_rank_is_named_with_its_signal_and_the_run_goes_on(tmp_path):
    import subprocess
    import sys

    from shardcheck.harness.core.records import load

    impl = FIXTURES / "model_utils" / "sleeps_in_forward.py"
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shardcheck.harness.cli",
            "run",
            "--impl",
            f"model_utils={impl}",
            "--op",
            "model_utils.DistributedLogprob",
            "--op",
            "model_utils.ChunkedDistributedLogprob",
            "--case",
            "b2s5*",
            "--topology",
            "tp=2",
            *FLOAT64_QUICK,
            "--timeout",
            "60",
            "--out",
            str(out),
            "--no-progress",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        events = out / "workers" / "w2-launch0" / "plan0" / "rank1.jsonl"
        deadline = time.time() + 120
        pid = None
        while time.time() < deadline:  # wait for rank 1 to be in the (slow) forward of the first case
            if events.is_file() and '"phase": "forward"' in events.read_text():
                pid = _worker_pid(out, 1)
                break
            time.sleep(0.2)
        assert pid, "rank 1 never reached the forward"
        os.kill(pid, signal.SIGKILL)
        stdout, _ = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 1, stdout
    rows = load(out)
    killed = rows[(rows["op"] == "model_utils.DistributedLogprob") & rows["case_id"].str.startswith("b2s5")]
    assert len(killed) and (killed["status"] == "error").all()
    for _, row in killed.iterrows():  # every check of the case names the rank and the signal
        assert row["message"].startswith("rank 1 (dp=0, cp=0, tp=1): died: SIGKILL"), row["message"]
        assert "rank 1 died: SIGKILL" in row["message"] and row["mismatch"]["rank"] == 1
        others = [r for r in row["per_rank"] if r["rank"] == 0]
        assert others and others[0]["status"] == "error"
        assert "rank(s) 0 waiting on rank(s) 1" in row["message"]
        assert "rank 0 (" not in row["message"]  # rank 0, torn down after the kill, is not blamed
    # the run went on: the other op ran in a relaunch and passed
    chunked = rows[rows["op"] == "model_utils.ChunkedDistributedLogprob"]
    assert len(chunked) and (chunked["status"] == "pass").all()
    assert "rerun: shardcheck run --suite model_utils --op model_utils.DistributedLogprob" in stdout


def test_a_driver_killed_outright_takes_its_ranks_with_it_mid_item(tmp_path):
    """A CI job cancelled with SIGKILL cannot end its ranks: each rank watches its driver and ends within a few
    seconds, even mid-item (here rank 1 in a 30 s sleep, rank 0 waiting on it in a collective), not after the rest
    of its plan or PEER_WAIT's hour."""
    import subprocess
    import sys

    impl = FIXTURES / "model_utils" / "sleeps_in_forward.py"
    out = tmp_path / "run"
    args = ["--impl", f"model_utils={impl}", "--op", "model_utils.DistributedLogprob", "--case", "b2s5*"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "shardcheck.harness.cli", "run", *args, "--topology", "tp=2", *FLOAT64_QUICK]
        + ["--timeout", "120", "--out", str(out), "--no-progress"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        events = out / "workers" / "w2-launch0" / "plan0" / "rank1.jsonl"
        deadline = time.time() + 120
        while time.time() < deadline and not (events.is_file() and '"phase": "forward"' in events.read_text()):
            time.sleep(0.2)
        pids = [_worker_pid(out, rank) for rank in (0, 1)]
        assert all(pids), "the ranks never reached the forward"
        proc.kill()
        proc.wait(timeout=30)
        gone_by = time.time() + 10  # the watch polls once a second; the sleep has ~30 s left
        while time.time() < gone_by and any(_running(pid) for pid in pids):
            time.sleep(0.2)
        assert not any(_running(pid) for pid in pids), f"ranks {pids} outlived their driver"
    finally:
        proc.kill()


def _running(pid: int) -> bool:
    """Whether `pid` is a process that has not ended (a zombie, ended and waiting for its parent, has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(") ")[2][:1] != "Z"
    except OSError:
        return False
