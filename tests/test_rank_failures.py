"""Ranks that hang, raise alone or die (tests/fixtures/model_utils/): the case errors within --timeout, names
the culprit rank, and the run goes on.  Runs are kept small (one topology, float64)."""

from __future__ import annotations

import pytest
from helpers import FIXTURES

TP2 = ("--topology", "dp=1,cp=1,tp=2", "--dtype", "float64", "--quick")


def _impl(name: str) -> tuple[str, str]:
    return ("--impl", f"model_utils={FIXTURES / 'model_utils' / name}.py")


@pytest.mark.parametrize(
    "module, culprit, words",
    [
        ("skips_collective", 1, "did not finish the case within"),  # rank 0 blocks in the all-reduce rank 1 skipped
        ("error_one_rank", 1, "RuntimeError: shard check failed"),
        ("rank_dies", 1, "rank 1 died: exit code 13"),
    ],
)
def test_hangs_errors_and_deaths_become_error_rows(run_shardcheck, module, culprit, words):
    """Never hang: the case errors within --timeout, names the culprit rank, and the run goes on."""
    run = run_shardcheck(
        "run",
        *_impl(module),
        "--op",
        "model_utils.DistributedLogprob",
        "--op",
        "model_utils.ChunkedDistributedLogprob",
        "--case",
        "b2s5*",
        *TP2,
        "--timeout",
        "5",
        timeout=300,
    )  # a loaded 2-core machine: launches take 20-30 s each
    assert run.returncode == 1, run.stdout + run.stderr
    rows = run.rows
    bad = rows[rows["op"] == "model_utils.DistributedLogprob"]
    forward = bad[bad["check"] == "forward"].iloc[0]
    assert forward["status"] == "error"
    assert forward["mismatch"]["rank"] == culprit, forward["message"]
    assert forward["message"].startswith(f"rank {culprit} (dp=0, cp=0, tp={culprit})")
    assert words in forward["message"]
    # the remaining cases ran in a relaunch and pass
    chunked = rows[rows["op"] == "model_utils.ChunkedDistributedLogprob"]
    assert len(chunked) and (chunked["status"] == "pass").all()


@pytest.mark.parametrize("blocked_rank_reported", [True, False])
def test_a_rank_that_skipped_a_collective_is_named_whether_or_not_the_blocked_rank_reported(
    tmp_path, blocked_rank_reported
):
    """Rank 1 skips an all-reduce (a wrong forward value), rank 0 blocks in it; rank 1 reports rank 0 missing at the
    barrier and exits, which closes rank 0's collective with "connection closed by peer".  Whether that error
    reaches rank 0's events before the driver ends the launch is a race: the forward row names rank 1 either way."""
    from shardcheck.harness.core.events import Events, events_path
    from shardcheck.harness.core.options import RunSettings
    from shardcheck.harness.core.plan_data import Item, Plan
    from shardcheck.harness.core.records import load
    from shardcheck.harness.driver.collect import Collector
    from shardcheck.harness.driver.run import close_run, open_run

    item = Item(
        id=0,
        suite="model_utils",
        op="model_utils.DistributedLogprob",
        case_id="b2s5v33",
        dtype="float64",
        topology=(1, 1, 2),
        world_size=2,
        seed=0,
        checks=["forward"],
        params={"B": 2},
    )
    plan = Plan(
        run_id="race",
        quick=True,
        settings=RunSettings(device="cpu", backend="gloo", timeout=5.0, seed=0),
        impl={"model_utils": "shardcheck.distributed_impl.model_utils"},
        items=[item],
    )
    run_dir = tmp_path / "run"
    events = {r: Events(events_path(run_dir / "events", r), r) for r in range(2)}
    for r in range(2):
        events[r].started(0)
        events[r].phase(0, "forward")
    events[1].checked(
        0,
        check="forward",
        coords={"dp": 0, "cp": 0, "tp": 1},
        status="fail",
        message="",
        max_abs_err=294.0,
        err_ratio=2.1e9,
        budget=1.4e-7,
        symptom="values",
        worst={"local_index": [0, 3], "global_index": [0, 3], "expected": -294.0, "got": 0.0},
    )
    events[1].stuck(0, [0], 5.0)
    if blocked_rank_reported:
        events[0].checked(
            0,
            check="forward",
            coords={"dp": 0, "cp": 0, "tp": 0},
            status="error",
            message="RuntimeError: Connection closed by peer",
            secondary=True,
            symptom="exception",
            error_type="RuntimeError",
            phase="forward",
        )
    for e in events.values():
        e.file.flush()
    writer, meta = open_run(run_dir, plan, ["shardcheck", "run"])
    collector = Collector(plan, [item], run_dir / "events", writer, 2)
    collector.poll()
    collector.abort(item, "")
    close_run(run_dir, writer, meta)
    forward = load(run_dir).iloc[0]
    assert forward["status"] == "error" and forward["mismatch"]["rank"] == 1, forward["message"]
    assert forward["message"].startswith("rank 1 (dp=0, cp=0, tp=1): |err| 294")
    assert "rank(s) 0 did not finish the case within 5s" in forward["message"]


def test_a_topology_whose_device_mesh_cannot_be_built_is_one_error_and_its_other_items_skipped(run_shardcheck):
    """Every rank raises building the mesh of dp1-cp1-tp2 (tests/fixtures/environment/: as torch 2.11's
    `_unflatten` raised on every mesh of the first GPU run): one error names the exception and where; the
    topology's other items, of every op, are skipped in the same launch's stead, not each run into it on a launch of
    its own; dp2's items run and pass."""
    fixture = FIXTURES / "environment" / "mesh_fails_at_tp2.py"
    ops = (
        "model_utils.DistributedLogprob",
        "model_utils._compute_distributed_log_softmax",
        "model_utils.all_to_all_sq2vp",
    )
    run = run_shardcheck(
        "run", "--impl", f"model_utils={fixture}", *[a for op in ops for a in ("--op", op)], "--quick",
        "--world-sizes", "2", "--topology", "dp=1,cp=1,tp=2", "--topology", "dp=2,cp=1,tp=1", "--dtype", "float64",
        fresh=True,  # the fixture's patch stays in its ranks' torch
    )  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr
    rows = run.rows
    tp2, dp2 = rows[rows["tp"] == 2], rows[rows["dp"] == 2]
    errors = tp2[tp2["status"] == "error"]
    assert errors[["op", "case_id"]].drop_duplicates().shape[0] == 1  # the topology's first item
    assert (errors["phase"] == "mesh").all()
    assert "ValueError: this torch builds no mesh with a TP dim of 2" in errors["message"].iloc[0]
    skipped = tp2[tp2["status"] == "skip"]
    assert set(skipped["op"]) == set(ops) and len(skipped) + len(errors) == len(tp2)
    assert skipped["message"].str.contains("the device mesh of dp1-cp1-tp2 was not built").all()
    assert len(dp2) and (dp2["status"] == "pass").all() and set(dp2["op"]) == set(ops)
    assert sorted(p.name for p in (run.out / "workers").iterdir()) == ["w2-launch0", "w2-launch1"]
    assert "skipped: skipped" not in run.stdout
