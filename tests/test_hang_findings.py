"""A rank that hangs or dies: the finding says where and why (harness/driver/postmortem.py): each live rank's stack
read as running or waiting (stacks.py), the ranks' collectives compared (flight.py, rank/flight_recorder.py), a
dead rank's last error lines (last_words.py); and the hang costs at most --timeout + 10 s."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
from helpers import FIXTURES, ROOT, Run

from shardcheck.harness import cli as shardcheck_cli
from shardcheck.harness.driver.pool import WorkerPool

TIMEOUT = 5
TP2 = (
    "--op",
    "model_utils.DistributedLogprob",
    "--case",
    "b2s5v33-scale300.0-masked0.2",
    "--topology",
    "dp=1,cp=1,tp=2",
    "--dtype",
    "float64",
    "--quick",
    "--timeout",
    str(TIMEOUT),
)
FIX = "tests/fixtures/model_utils"


def _run(run_shardcheck, module: str):
    run = run_shardcheck("run", "--impl", f"model_utils={FIXTURES / 'model_utils' / module}.py", *TP2, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    forward = run.rows.set_index("check").loc["forward"]
    # from the case's start on its ranks to the driver ending it (the launch's start-up is not the hang's)
    return run, forward, forward["item_seconds"]


def _torchfrtrace(run, forward) -> str:
    """What torch's flight recorder analyzer says of the hang's records (failures/<item>/torch-flight-recorder/)."""
    folder = run.out / forward["message"].split("stacks and collectives: ")[1].split(";")[0] / "torch-flight-recorder"
    command = shutil.which("torchfrtrace", path=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    assert command, "torch's console script torchfrtrace is not installed"
    analysis = subprocess.run([command, str(folder)], capture_output=True, text=True, timeout=120)
    assert analysis.returncode == 0, analysis.stderr
    return analysis.stdout + analysis.stderr


def test_a_rank_spinning_in_a_python_loop_is_named_running_in_its_function_and_line(run_shardcheck):
    run, forward, seconds = _run(run_shardcheck, "spins_in_forward")
    assert seconds < TIMEOUT + 10, seconds  # not the watchdog's minute
    assert forward["status"] == "error" and forward["symptom"] == "hung"
    assert forward["culprit_ranks"] == [1] and forward["blocked_ranks"] == [0]
    assert forward["mismatch"]["rank"] == 1, forward["message"]
    assert forward["error_where"] == f"{FIX}/spins_in_forward.py:19"
    message = forward["message"]
    assert (
        f"rank 1: running in {FIX}/spins_in_forward.py:19 _count_up_to ← {FIX}/spins_in_forward.py:29 forward"
        in message
    )
    assert "rank 0: waiting in all_reduce #1 on tp at distributed_impl/model_utils.py:" in message
    assert "rank 1 never entered all_reduce #1 on tp (the others did" in message
    # the finding line the CLI prints carries it, and the whole stacks are kept
    assert "rank 1 did not finish (in forward): rank 0: waiting in all_reduce #1 on tp" in run.stdout
    folder = run.out / message.split("stacks and collectives: ")[1].split(";")[0]
    dump = (folder / "hang-stacks.txt").read_text()
    assert "=== rank 0 ===" in dump and "=== rank 1 ===" in dump and "in _count_up_to" in dump
    records = (folder / "collectives.txt").read_text()
    assert "rank 1: 0 collective(s) in this case" in records and "rank 0: 1 collective(s) in this case" in records


def test_two_ranks_issuing_different_collectives_is_a_collective_mismatch_naming_both_calls(run_shardcheck):
    run, forward, seconds = _run(run_shardcheck, "mismatched_collective")
    assert seconds < TIMEOUT + 10, seconds
    assert forward["symptom"] == "hung"
    assert (
        f"collective mismatch on tp: rank 0 in all_reduce #3 [2, 5] float64 at {FIX}/mismatched_collective.py:24 "
        f"forward, rank 1 in all_gather #3 [2, 5] float64 at {FIX}/mismatched_collective.py:22 forward"
    ) in forward["message"]
    analysis = _torchfrtrace(run, forward)
    assert "Collective sequence number: 3 has errors" in analysis, analysis
    assert (
        "Expected collective type: 'all_reduce' does not match found collective type: 'all_gather'" in analysis
        or "Expected collective type: 'all_gather' does not match found collective type: 'all_reduce'" in analysis
    ), analysis


def test_a_rank_that_skips_a_collective_is_named_with_the_call_it_never_entered(run_shardcheck):
    run, forward, seconds = _run(run_shardcheck, "skips_collective")
    assert seconds < TIMEOUT + 10, seconds
    assert forward["mismatch"]["rank"] == 1
    assert (
        f"rank 1 never entered all_reduce #3 on tp (the others did, at {FIX}/skips_collective.py:21 forward); "
        "rank 1 last on tp: all_reduce #2"
    ) in forward["message"]
    assert f"rank 0: waiting in all_reduce #3 on tp at {FIX}/skips_collective.py:21 forward" in forward["message"]
    assert "rank 1: finished its part, waiting for the others at the case's barrier" in forward["message"]
    # the same records open in torch's analyzer (`torchfrtrace`), which names the rank that never joined
    analysis = _torchfrtrace(run, forward)
    assert "Not all ranks joining collective, sequence number: 3" in analysis, analysis
    assert "collective: gloo:all_reduce" in analysis and "missing ranks: {1}" in analysis, analysis
    assert f"forward at {ROOT}/{FIX}/skips_collective.py:21" in analysis, analysis


def test_a_gloo_abort_carries_gloos_message_and_the_phase(run_shardcheck):
    run, forward, seconds = _run(run_shardcheck, "collective_sizes_differ")
    assert seconds < TIMEOUT + 10, seconds
    assert forward["symptom"] == "died" and forward["error_type"] == "SIGABRT" and forward["phase"] == "forward"
    assert "op.preamble.length <= op.nbytes" in forward["error_message"], forward["error_message"]
    assert "gloo::EnforceNotMet" in forward["error_message"]
    dead = forward["culprit_ranks"][0]
    assert f"rank {dead} died: SIGABRT (in forward): terminate called" in run.stdout
    # both ranks entered all_reduce #3 with different sizes: the records say so
    assert (
        f"collective mismatch on tp: rank 0 in all_reduce #3 [10] float64 at {FIX}/collective_sizes_differ.py:24 "
        f"forward, rank 1 in all_reduce #3 [20] float64"
    ) in forward["message"]


def test_a_rank_that_exits_with_an_exception_carries_it_into_the_finding(run_shardcheck):
    """A rank whose process ends with an uncaught exception (not one the harness caught in the op): its message and
    line are in the finding, not only "exit code 1"."""
    run, forward, seconds = _run(run_shardcheck, "exits_with_exception")
    assert forward["symptom"] == "died" and forward["error_type"] == "exit code 1"
    assert "ShardTableError: shard table corrupt on rank 1" in forward["error_message"], forward["error_message"]
    assert forward["error_message"].endswith(f"(at {FIX}/exits_with_exception.py:23 in forward)")
    assert "rank 1 died: exit code 1 (in forward): " in run.stdout


def test_a_real_dtensor_hang_names_view_groups_running_on_the_rank_with_the_empty_piece(run_shardcheck):
    """torch 2.13's DTensor.reshape(-1, 8) of a [0, 8, 8] piece spins in view_groups (tests/fixtures/hangs): at DP 4
    with B = 3 only rank 3 has the empty piece; the others wait in the op's all_reduce.  The condition is the real
    one (B small for DP 4), not an incidental parameter, and the hang costs --timeout plus seconds."""
    suite = FIXTURES / "hangs" / "dtensor_view_spin.py"
    run = run_shardcheck(
        "run",
        "--suite-path",
        str(suite),
        "--topology",
        "dp=2,cp=1,tp=1",
        "--topology",
        "dp=4,cp=1,tp=1",
        "--timeout",
        str(TIMEOUT),
        timeout=120,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    rows = run.rows
    hung = rows[rows["symptom"] == "hung"]
    assert len(hung) == 1, hung
    row = hung.iloc[0]
    assert row["case_id"] == "b3" and (row["dp"], row["cp"], row["tp"]) == (4, 1, 1)
    assert row["item_seconds"] < TIMEOUT + 10, row["item_seconds"]
    assert row["culprit_ranks"] == [3] and row["error_where"].startswith("torch/distributed/tensor/_ops/_view_ops.py:")
    message = row["message"]
    spin = re.search(
        r"rank 3: running in torch/distributed/tensor/_ops/_view_ops.py:\d+ view_groups ← "
        r"tests/fixtures/hangs/dtensor_view_spin.py:20 flat_row_sum",
        message,
    )
    assert spin, message
    assert (
        "ranks 0, 1, 2: waiting in all_reduce #1 on dp at tests/fixtures/hangs/dtensor_view_spin.py:22 flat_row_sum"
    ) in message
    # every other item passed: B = 3 at DP 2 and B = 4, 8 at DP 4 (run before the hang) separate it
    assert set(rows.loc[rows["symptom"] != "hung", "status"]) == {"pass"}, rows[["case_id", "dp", "status"]]
    line = next(ln for ln in run.stdout.splitlines() if "ERROR dtensor_view.flat_row_sum:" in ln)  # the findings line
    assert "exactly at dp ≥ 4, when B ≤ 3" in line, line


def test_a_rank_stuck_before_its_first_item_is_named_where_it_is_and_ends_at_the_items_timeout(run_shardcheck):
    """Rank 1 never gets past loading its suite; rank 0 runs the case and waits for it in the op's all_reduce."""
    suite = FIXTURES / "hangs" / "rank1_stuck_at_startup.py"
    run = run_shardcheck(
        "run", "--suite-path", str(suite), "--topology", "dp=1,cp=1,tp=2", "--timeout", str(TIMEOUT), timeout=120
    )
    assert run.returncode == 1, run.stdout + run.stderr
    forward = run.rows.set_index("check").loc["forward"]
    assert forward["symptom"] == "hung" and forward["culprit_ranks"] == [1]
    assert forward["item_seconds"] < TIMEOUT + 10, forward["item_seconds"]
    assert (
        "rank 1: running in tests/fixtures/hangs/_startup.py:25 block_ranks ← "
        "tests/fixtures/hangs/rank1_stuck_at_startup.py:15 cases"
    ) in forward["message"], forward["message"]
    assert (
        "rank 0: waiting in all_reduce #1 on tp at tests/fixtures/hangs/_startup.py:16 tp_row_sum" in forward["message"]
    )


def test_a_launch_whose_ranks_never_come_up_ends_at_timeout_plus_10s_and_says_where_they_were(run_shardcheck):
    """No rank reports anything: the watchdog ends the launch at --timeout + WATCHDOG_GRACE (10 s), not a minute
    later, with every rank's stack in the words."""
    suite = FIXTURES / "hangs" / "never_come_up.py"
    run = run_shardcheck(
        "run", "--suite-path", str(suite), "--topology", "dp=1,cp=1,tp=2", "--timeout", str(TIMEOUT), timeout=120
    )
    assert run.returncode == 1, run.stdout + run.stderr
    forward = run.rows.set_index("check").loc["forward"]
    assert forward["status"] == "error", forward["message"]
    quiet = re.search(r"no progress for (\d+)s: workers killed by the watchdog", forward["message"])
    assert quiet and int(quiet[1]) <= TIMEOUT + 11, forward["message"]  # (the 11th second: the driver's poll)
    assert (
        "before their first item, ranks 0, 1: running in tests/fixtures/hangs/_startup.py:25 block_ranks ← "
        "tests/fixtures/hangs/never_come_up.py:15 cases"
    ) in forward["message"], forward["message"]


def test_without_the_flight_recorder_a_hang_still_has_the_stacks_and_says_no_collectives_were_recorded(
    tmp_path, monkeypatch
):
    """SHARDCHECK_FLIGHT_RECORDER=0 (to measure the recorder's cost, or rule it out): no rank writes records, the
    finding names the spinning rank from its stack alone and says the records are off."""
    monkeypatch.setenv("SHARDCHECK_FLIGHT_RECORDER", "0")
    out = tmp_path / "run"
    argv = [
        "run",
        "--impl",
        f"model_utils={FIXTURES / 'model_utils' / 'spins_in_forward'}.py",
        *TP2,
        "--out",
        str(out),
        "--no-progress",
    ]
    stdout = io.StringIO()
    # ranks of its own, started now, inherit the switch (the session's shared ranks were started without it)
    with WorkerPool(tmp_path / "ranks") as pool, contextlib.redirect_stdout(stdout):
        code = shardcheck_cli.main(argv, pool=pool)
    run = Run(code, stdout.getvalue(), "", out)
    assert run.returncode == 1, run.stdout
    forward = run.rows.set_index("check").loc["forward"]
    assert forward["symptom"] == "hung" and forward["culprit_ranks"] == [1]
    assert forward["item_seconds"] < TIMEOUT + 10, forward["item_seconds"]
    message = forward["message"]
    assert f"rank 1: running in {FIX}/spins_in_forward.py:19 _count_up_to" in message
    assert "rank 0: waiting in all_reduce at distributed_impl/model_utils.py:" in message  # (no record: no #number)
    assert "no collectives recorded (SHARDCHECK_FLIGHT_RECORDER=0)" in message and "never entered" not in message
    assert not list((run.out / "workers").rglob("*.collectives*"))


def test_a_gloo_abort_while_the_harness_judges_a_lazily_waited_output_says_judging(run_shardcheck):
    """The op returns an unwaited functional all-gather whose ranks pass different sizes: gloo aborts rank 0 when
    the harness first uses the output (the wait), so the phase is judging, not forward, with gloo's message."""
    suite = FIXTURES / "deaths" / "lazy_gather_sizes_differ.py"
    run = run_shardcheck(
        "run", "--suite-path", str(suite), "--topology", "dp=1,cp=1,tp=2", "--timeout", str(TIMEOUT), timeout=120
    )
    assert run.returncode == 1, run.stdout + run.stderr
    forward = run.rows.set_index("check").loc["forward"]
    assert forward["symptom"] == "died" and forward["error_type"] == "SIGABRT", forward["message"]
    assert forward["phase"] == "judging" and forward["culprit_ranks"] == [0], forward["message"]
    assert "op.preamble.length <= op.nbytes. 96 vs 48" in forward["error_message"], forward["error_message"]
    assert "rank 0 died: SIGABRT (in judging): terminate called" in run.stdout
    assert forward["item_seconds"] < TIMEOUT + 10, forward["item_seconds"]
    assert (
        "collective mismatch on tp: rank 0 in all_gather #1 [2, 6] float64 at "
        "tests/fixtures/deaths/lazy_gather_sizes_differ.py:26 gather_rows, rank 1 in all_gather #1 [4, 6] float64"
    ) in forward["message"]


STANDALONE_TIMEOUT = 20  # a fresh torchrun's first item imports torch's compiler stack: 0.5 s idle, seconds loaded
HANG_TIMEOUT = (
    10  # the hang tests wait it out: shorter (the raise and death tests end before, at ~10 s, a raise's grace)
)


def _torchrun(tmp_path, module: str, dtypes: str = "float64", timeout: float = STANDALONE_TIMEOUT):
    """A hand-written torchrun of two CPU ranks on one case of `tests/fixtures/model_utils/<module>.py`: (the
    process, its --out, its wall seconds, the rows)."""
    out = tmp_path / "by-hand"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    started = time.time()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "shardcheck.harness.standalone",
            "--impl",
            f"model_utils={FIXTURES / 'model_utils' / module}.py",
            *TP2[:-5],
            "--dtype",
            dtypes,
            "--quick",
            "--timeout",
            str(timeout),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    seconds = time.time() - started
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return proc, out, seconds, rows


@pytest.mark.timeout(300)
def test_a_hang_under_a_hand_written_torchrun_names_where_each_rank_was_and_the_collective(tmp_path):
    """harness/standalone.py has no driver to signal its ranks: each dumps its own stack into --out at --timeout and
    records its collectives there; rank 0's watchdog thread (its main thread waits in gloo) folds them into the
    finding as the driver does, completes run.json and the report, and exits 1 at once: torchrun ends rank 1."""
    proc, out, seconds, rows = _torchrun(tmp_path, "spins_in_forward", timeout=HANG_TIMEOUT)
    forward = next(r for r in rows if r["check"] == "forward")
    assert forward["symptom"] == "hung" and forward["culprit_ranks"] == [1], forward["message"]
    # from the case's start to the finding: the timeout and seconds, not gloo's own timeout (--timeout + 120 s)
    assert forward["item_seconds"] < HANG_TIMEOUT + 10, forward["item_seconds"]
    assert seconds < HANG_TIMEOUT + 90, seconds  # (the start-up of a torchrun on a loaded machine included)
    assert (
        f"rank 1: running in {FIX}/spins_in_forward.py:19 _count_up_to ← {FIX}/spins_in_forward.py:29 forward"
        in forward["message"]
    )
    assert "rank 0: waiting in all_reduce #1 on tp at distributed_impl/model_utils.py:" in forward["message"]
    assert "rank 1 never entered all_reduce #1 on tp (the others did" in forward["message"]
    assert "rank 0 took the ranks' stacks and ended the hand-launched run" in forward["message"]
    folder = out / forward["message"].split("stacks and collectives: ")[1].split(";")[0]
    assert "in _count_up_to" in (folder / "hang-stacks.txt").read_text()
    # the run is whole, as `shardcheck run` leaves it: run.json completed, the report written
    meta = json.loads((out / "run.json").read_text())
    assert meta["summary"] == {"error": 3} and "end" in meta, meta
    assert "_count_up_to" in (out / "report.md").read_text()
    assert "the run ended at model_utils.DistributedLogprob b2s5v33-scale300.0-masked0.2 (hung)" in proc.stderr


@pytest.mark.timeout(300)
def test_a_hand_launched_rank_0_stuck_holding_the_gil_is_named_by_the_rank_that_takes_over(tmp_path):
    """Rank 0 is stuck in native code that holds the GIL (a regular expression without end): none of its Python
    threads runs, so rank 1 (waiting in gloo) claims the finding after TAKEOVER seconds, names rank 0's place from
    the stack rank 0's faulthandler timer dumped, skips the item left and completes the run."""
    proc, out, seconds, rows = _torchrun(
        tmp_path, "rank0_holds_the_gil", dtypes="float64,float32", timeout=HANG_TIMEOUT
    )
    hung = [r for r in rows if r["symptom"] == "hung"]
    assert {r["dtype"] for r in hung} == {"float64"} and len(hung) == 3, rows
    forward = next(r for r in hung if r["check"] == "forward")
    assert forward["culprit_ranks"] == [0] and forward["blocked_ranks"] == [1], forward["message"]
    assert forward["item_seconds"] < HANG_TIMEOUT + 10, forward["item_seconds"]
    assert seconds < HANG_TIMEOUT + 90, seconds
    message = forward["message"]
    assert (
        "rank 0: running in re/__init__.py:" in message
        and f"fullmatch ← {FIX}/rank0_holds_the_gil.py:20 _parse_shard_table" in message
    ), message
    assert "rank 1: waiting in all_reduce #1 on tp at distributed_impl/model_utils.py:" in message
    assert "rank 0 never entered all_reduce #1 on tp (the others did" in message
    assert "rank 1 took the ranks' stacks and ended the hand-launched run" in message
    assert forward["error_where"].startswith("re/__init__.py:"), forward["error_where"]
    skipped = [r for r in rows if r["dtype"] == "float32"]
    assert len(skipped) == 3 and {r["status"] for r in skipped} == {"skip"}, skipped
    assert skipped[0]["message"].startswith(
        "not run: the run ended at model_utils.DistributedLogprob case "
        "b2s5v33-scale300.0-masked0.2 float64 at dp1-cp1-tp2 (hung)"
    )
    meta = json.loads((out / "run.json").read_text())
    assert meta["summary"] == {"error": 3, "skip": 3} and "end" in meta, meta
    assert "_parse_shard_table" in (out / "report.md").read_text()
    assert "shardcheck worker (rank 1): the run ended at model_utils.DistributedLogprob" in proc.stderr


@pytest.mark.timeout(300)
def test_a_hand_launched_rank_that_dies_is_named_with_its_own_last_error_lines(tmp_path):
    """Rank 1 ends with an uncaught exception; torchrun ends rank 0 with SIGTERM, which rank 0's thread answers: the
    finding names rank 1 dead (it did not answer), with the exception and line from its stderr (teed into
    workers/rank1.log), and the run is completed."""
    proc, out, seconds, rows = _torchrun(tmp_path, "exits_with_exception", dtypes="float64,float32")
    forward = next(r for r in rows if r["check"] == "forward" and r["dtype"] == "float64")
    assert forward["symptom"] == "died" and forward["culprit_ranks"] == [1], forward["message"]
    assert forward["phase"] == "forward" and forward["error_type"] == "its process ended", forward
    assert forward["error_message"].endswith(
        f"ShardTableError: shard table corrupt on rank 1 (at {FIX}/exits_with_exception.py:23 in forward)"
    ), forward["error_message"]
    assert forward["item_seconds"] < STANDALONE_TIMEOUT, forward["item_seconds"]  # at the death, not the timeout
    assert seconds < STANDALONE_TIMEOUT + 90, seconds
    assert "ShardTableError" in (out / "workers" / "rank1.log").read_text()
    skipped = [r for r in rows if r["dtype"] == "float32"]
    assert {r["status"] for r in skipped} == {"skip"} and "(rank 1 died (its process ended))" in skipped[0]["message"]
    assert json.loads((out / "run.json").read_text())["summary"] == {"error": 3, "skip": 3}


@pytest.mark.timeout(300)
def test_a_hand_launched_gloo_abort_carries_gloos_message_whichever_rank_died(tmp_path):
    """The ranks enter all_reduce #3 with different sizes: gloo aborts one of them (SIGABRT, its message on its
    stderr); torchrun ends the other, which writes the finding (rank 0 at once, or rank 1 after TAKEOVER when rank 0
    is the one that died), with gloo's message, the phase and the records compared."""
    proc, out, seconds, rows = _torchrun(tmp_path, "collective_sizes_differ")
    forward = next(r for r in rows if r["check"] == "forward")
    assert forward["symptom"] == "died" and forward["phase"] == "forward", forward["message"]
    assert "op.preamble.length <= op.nbytes" in forward["error_message"], forward["error_message"]
    assert "gloo::EnforceNotMet" in forward["error_message"]
    dead = forward["culprit_ranks"]
    assert dead in ([0], [1]), dead
    assert f"shardcheck worker (rank {1 - dead[0]}): the run ended at" in proc.stderr
    assert (
        f"collective mismatch on tp: rank 0 in all_reduce #3 [10] float64 at {FIX}/collective_sizes_differ.py:24 "
        f"forward, rank 1 in all_reduce #3 [20] float64"
    ) in forward["message"]
    assert forward["item_seconds"] < STANDALONE_TIMEOUT, forward["item_seconds"]
    assert json.loads((out / "run.json").read_text())["summary"] == {"error": 3}


@pytest.mark.timeout(300)
def test_a_hand_launched_rank_that_raises_alone_ends_the_run_before_the_timeout_with_its_peers_stack(tmp_path):
    """Rank 1 raises in the forward and waits at the case's check-in; rank 0 blocks in the all_reduce rank 1 left.
    Rank 1 stops waiting RAISED_GRACE after its raise, takes rank 0's stack (SIGUSR1: same host) and, rank 0 not
    claiming, writes the finding: the exception is the cause, rank 0 is named waiting, before --timeout."""
    proc, out, seconds, rows = _torchrun(tmp_path, "error_one_rank")
    forward = next(r for r in rows if r["check"] == "forward")
    assert forward["symptom"] == "exception" and forward["culprit_ranks"] == [1], forward["message"]
    assert forward["error_type"] == "RuntimeError" and forward["phase"] == "forward", forward
    assert forward["item_seconds"] < STANDALONE_TIMEOUT, forward["item_seconds"]  # at the raise's grace
    message = forward["message"]
    assert "rank 0: waiting in all_reduce #1 on tp at distributed_impl/model_utils.py:" in message, message
    assert "rank 1: finished its part, waiting for the others at the case's barrier" in message
    assert "within --timeout" not in message
    assert "hung after rank(s) 1 raised RuntimeError" in proc.stderr
