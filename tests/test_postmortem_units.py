"""The pieces of a hang's finding, without ranks: faulthandler dumps read as running / waiting / at the barrier
(harness/driver/stacks.py), flight records compared (harness/driver/flight.py, harness/rank/flight_recorder.py),
a dead rank's last error lines (harness/driver/last_words.py)."""

from __future__ import annotations

import signal
import subprocess
import sys

import torch

from shardcheck.harness.driver import flight, stacks
from shardcheck.harness.driver.last_words import last_words
from shardcheck.harness.rank.flight_recorder import RING, SLOT, FlightRecorder

TORCH = "/venv/lib/python3.11/site-packages/torch"
DUMP = f"""Thread 0x00007f00000000aa (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait

Current thread 0x00007f00000000bb (most recent call first):
  File "{TORCH}/distributed/tensor/_ops/_view_ops.py", line 483 in view_groups
  File "{TORCH}/distributed/tensor/_dispatch.py", line 160 in dispatch
  File "/work/my_suite.py", line 88 in run
  File "/site/shardcheck/harness/rank/worker.py", line 300 in run
  File "/site/shardcheck/harness/rank/worker.py", line 610 in serve
"""
WAITING = f"""Current thread 0x00007f00000000bb (most recent call first):
  File "{TORCH}/distributed/distributed_c10d.py", line 2950 in all_reduce
  File "{TORCH}/distributed/c10d_logger.py", line 81 in wrapper
  File "/work/my_ops.py", line 57 in forward
  File "/site/shardcheck/harness/rank/worker.py", line 610 in serve
"""
AT_BARRIER = """Current thread 0x00007f00000000bb (most recent call first):
  File "/site/shardcheck/harness/rank/worker.py", line 265 in barrier
  File "/site/shardcheck/harness/rank/worker.py", line 240 in run
  File "/site/shardcheck/harness/rank/worker.py", line 610 in serve
"""


def test_a_dump_reads_as_running_in_torch_with_the_callers_line_waiting_in_a_collective_or_at_the_barrier():
    frames = stacks.main_stack(DUMP)  # the thread that runs serve, not the idle one
    assert stacks.state(frames) == stacks.State.RUNNING
    assert (
        stacks.describe(frames)
        == "running in torch/distributed/tensor/_ops/_view_ops.py:483 view_groups ← /work/my_suite.py:88 run"
    )
    waiting = stacks.main_stack(WAITING)
    assert stacks.state(waiting) == stacks.State.WAITING
    assert stacks.describe(waiting) == "waiting in all_reduce at /work/my_ops.py:57 forward"
    record = {"kind": "all_reduce", "seq": 7, "dim": "dp", "where": "/work/my_ops.py:57 forward"}
    assert stacks.describe(waiting, record) == "waiting in all_reduce #7 on dp at /work/my_ops.py:57 forward"
    assert stacks.state(stacks.main_stack(AT_BARRIER)) == stacks.State.BARRIER
    text, running, where = stacks.describe_ranks({0: WAITING, 1: WAITING, 2: DUMP, 3: WAITING}, {})
    assert running == [2] and where == "torch/distributed/tensor/_ops/_view_ops.py:483"
    assert text == (
        "ranks 0, 1, 3: waiting in all_reduce at /work/my_ops.py:57 forward; rank 2: running in "
        "torch/distributed/tensor/_ops/_view_ops.py:483 view_groups ← /work/my_suite.py:88 run"
    )


IN_A_SHAPE_GUARD = f"""Current thread 0x00007f00000000bb (most recent call first):
  File "{TORCH}/fx/experimental/symbolic_shapes.py", line 1540 in _guard_or
  File "{TORCH}/fx/experimental/symbolic_shapes.py", line 1571 in guard_or_false
  File "{TORCH}/distributed/tensor/_ops/_view_ops.py", line 483 in view_groups
  File "{TORCH}/distributed/tensor/_dispatch.py", line 265 in _propagate_op_sharding_dispatch_slow_path
  File "/work/my_suite.py", line 20 in flat_row_sum
  File "/site/shardcheck/harness/rank/worker.py", line 610 in serve
"""
IN_A_TORCH_KERNEL = f"""Current thread 0x00007f00000000bb (most recent call first):
  File "{TORCH}/_tensor.py", line 900 in __mul__
  File "/work/my_suite.py", line 21 in flat_row_sum
  File "/site/shardcheck/harness/rank/worker.py", line 610 in serve
"""


def test_a_spin_sampled_inside_a_generic_torch_helper_is_named_by_the_torch_distributed_frame_that_called_it():
    """DTensor's view propagation loops in view_groups, calling torch/fx's shape guards: a stack sample lands in
    either, and the finding names the same frame whichever it was."""
    frames = stacks.main_stack(IN_A_SHAPE_GUARD)
    assert stacks.state(frames) == stacks.State.RUNNING
    assert stacks.describe(frames) == (
        "running in torch/distributed/tensor/_ops/_view_ops.py:483 view_groups ← /work/my_suite.py:20 flat_row_sum"
    )
    _, running, where = stacks.describe_ranks({0: WAITING, 1: IN_A_SHAPE_GUARD}, {})
    assert running == [1] and where == "torch/distributed/tensor/_ops/_view_ops.py:483"
    # no torch.distributed frame between the helper and the user's code: the innermost frame is named
    kernel = stacks.main_stack(IN_A_TORCH_KERNEL)
    assert stacks.describe(kernel) == "running in torch/_tensor.py:900 __mul__ ← /work/my_suite.py:21 flat_row_sum"


def _rec(seq, kind, shape, dtype="float32", group="g1", dim="tp", where="/work/a.py:10 f"):
    return {
        "n": seq,
        "plan": 0,
        "item": 0,
        "group": group,
        "dim": dim,
        "seq": seq,
        "kind": kind,
        "shape": shape,
        "dtype": dtype,
        "where": where,
    }


def test_flight_records_compared_name_a_mismatch_a_collective_never_entered_or_nothing():
    same = [_rec(1, "all_reduce", [4, 6])]
    agree = flight.compare({0: same, 1: list(same)}, (1, 1, 2))
    assert agree.text == "" and agree.culprits == []
    mismatch = flight.compare(
        {
            0: same + [_rec(2, "all_reduce", [4, 6], where="/work/a.py:57 f")],
            1: same + [_rec(2, "all_gather", [8], "int64", where="/work/a.py:60 g")],
        },
        (1, 1, 2),
    )
    assert mismatch.text == (
        "collective mismatch on tp: rank 0 in all_reduce #2 [4, 6] float32 at /work/a.py:57 f, "
        "rank 1 in all_gather #2 [8] int64 at /work/a.py:60 g"
    )
    # three ranks agree, one differs: the odd one is the culprit
    four = {r: same + [_rec(2, "all_reduce", [4, 6] if r != 2 else [4, 7])] for r in range(4)}
    odd = flight.compare(four, (1, 1, 4))
    assert odd.culprits == [2] and odd.text.startswith(
        "collective mismatch on tp: ranks 0, 1, 3 in all_reduce #2 [4, 6]"
    )
    skipped = flight.compare({0: same + [_rec(2, "all_reduce", [4, 6], where="/work/a.py:57 f")], 1: same}, (1, 1, 2))
    assert skipped.culprits == [1]
    assert skipped.text == (
        "rank 1 never entered all_reduce #2 on tp (the others did, at /work/a.py:57 f); "
        "rank 1 last on tp: all_reduce #1 [4, 6] float32 at /work/a.py:10 f"
    )
    # a rank with no record at all on the group is still one of its members (from the topology)
    none = flight.compare({0: same, 1: []}, (1, 1, 2))
    assert none.culprits == [1] and "it entered no collective on tp in this case" in none.text
    # tensors that legitimately differ (all_to_all splits) are compared by kind only
    a2a = flight.compare({0: [_rec(1, "all_to_all", [3])], 1: [_rec(1, "all_to_all", [5])]}, (1, 1, 2))
    assert a2a.text == ""


def test_the_recorder_keeps_the_last_records_in_its_ring_in_order(tmp_path):
    rec = FlightRecorder(tmp_path, 0)
    rec.begin_item(0, 0, {"g1": "tp"})
    x = torch.randn(3, 2, generator=torch.Generator().manual_seed(0))
    for _ in range(RING * 2 + 10):
        rec.record("all_reduce", "g1", x, "/work/a.py:1 f")
    records = flight.read(tmp_path, 0)  # (no flush: the mapping is the file's page cache)
    assert len(records) == RING
    assert records[-1]["seq"] == RING * 2 + 10 and records[-1]["shape"] == [3, 2] and records[-1]["dtype"] == "float32"
    assert [r["seq"] for r in records] == list(range(RING + 11, RING * 2 + 11))  # the last ones, in order
    rec.begin_item(0, 1, {})
    rec.record("barrier", "g1", None, "/work/a.py:2 g")
    rec.record("all_reduce", "g1", torch.tensor(1.5, dtype=torch.float64), "/work/" + "d" * 900 + "/b.py:3 h")
    last = flight.read(tmp_path, 0)[-2:]
    assert (last[0]["item"], last[0]["seq"], last[0]["dim"], last[0]["shape"], last[0]["dtype"]) == (
        1,
        1,
        "tp",
        None,
        None,
    )
    # a 0-d tensor's shape is [], and a calling line too long for its slot keeps its end (file, line, function)
    assert last[1]["shape"] == [] and last[1]["dtype"] == "float64" and last[1]["seq"] == 2
    assert last[1]["where"].startswith("...") and last[1]["where"].endswith("ddd/b.py:3 h"), last[1]["where"]


def test_a_torn_slot_is_left_out_and_a_rank_killed_by_sigkill_leaves_every_record(tmp_path):
    """A record is a store into a shared mapping of the file: no flush, no exit handler, and SIGKILL keeps it."""
    code = (
        "import os, signal, sys, torch\n"
        "from pathlib import Path\n"
        "from shardcheck.harness.rank.flight_recorder import FlightRecorder\n"
        "rec = FlightRecorder(Path(sys.argv[1]), 3)\n"
        "rec.begin_item(0, 7, {'g': 'dp'})\n"
        "for i in range(5): rec.record('all_gather', 'g', torch.zeros(i + 1, 2), f'/w/x.py:{i} f')\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    records = flight.read(tmp_path, 3)
    assert [(r["seq"], r["shape"], r["where"]) for r in records] == [
        (i + 1, [i + 1, 2], f"/w/x.py:{i} f") for i in range(5)
    ]
    # a slot half overwritten (a rank killed mid-write): its two record numbers differ, and it is not read
    path = tmp_path / "rank3.collectives"
    data = bytearray(path.read_bytes())
    at = 5 * SLOT  # record n=5's slot
    torn = b"9\t0\t7\tg\tdp\t9\tall_gather\t"
    data[at : at + len(torn)] = torn
    path.write_bytes(bytes(data))
    assert [r["seq"] for r in flight.read(tmp_path, 3)] == [1, 2, 3, 4]


def test_a_dead_ranks_last_words_are_its_native_abort_or_its_last_exception_with_where():
    gloo = (
        "some warning\nterminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
        "  what():  [enforce fail at pair.cc:446] op.preamble.length <= op.nbytes. 192 vs 128\n"
    )
    assert last_words(gloo) == (
        "terminate called after throwing an instance of 'gloo::EnforceNotMet' what():  "
        "[enforce fail at pair.cc:446] op.preamble.length <= op.nbytes. 192 vs 128"
    )
    python = (
        'Traceback (most recent call last):\n  File "/work/x.py", line 12, in load\n    raise ValueError(n)\n'
        "ValueError: B=0 < dp=4\n"
    )
    assert last_words(python) == "ValueError: B=0 < dp=4 (at /work/x.py:12 in load)"
    assert last_words("all fine\n") == ""
    # under torchrun torch prefixes a rank's lines: read through it
    prefixed = "".join(f"[rank1]:{line}\n" for line in python.splitlines())
    assert last_words(prefixed) == "ValueError: B=0 < dp=4 (at /work/x.py:12 in load)"


def test_a_hand_launched_ranks_own_timer_dump_is_read_back_its_last_one_and_only_if_fresh(tmp_path):
    """harness/standalone.py: each rank dumps its stack itself at --timeout (faulthandler.dump_traceback_later,
    "Timeout (0:00:05)!" then the threads) into the shared folder; rank 0 reads each rank's last dump."""
    import time

    from shardcheck.harness.core.events import stack_path

    old = "Timeout (0:00:05)!\n" + WAITING
    stack_path(tmp_path, 0).write_text(old + "\nTimeout (0:00:05)!\n" + AT_BARRIER)
    stack_path(tmp_path, 1).write_text("Timeout (0:00:05)!\n" + DUMP)
    since = time.time() - 5
    dumps = stacks.dumped_since(tmp_path, [0, 1, 2], since, wait=0.2)  # rank 2 wrote nothing: left out
    assert sorted(dumps) == [0, 1]
    assert stacks.state(stacks.main_stack(dumps[0])) == stacks.State.BARRIER  # the last dump, not the older one
    text, running, _ = stacks.describe_ranks(dumps, {})
    assert running == [1] and "rank 1: running in torch/distributed/tensor/_ops/_view_ops.py:483 view_groups" in text
    assert stacks.dumped_since(tmp_path, [0, 1], time.time() + 60, wait=0.1) == {}  # dumps older than the item
