"""Scale: what a run at 8 and 16 ranks needs of the harness itself.

- A harness exception on a rank (here: a layout it cannot apply) is an error row naming the exception and the
  harness line, the rank goes on to the next item, and the run says it is the harness's fault.
"""

from __future__ import annotations

from helpers import BROKEN, FIXTURES, ROOT, shardcheck

LAYOUT_CANNOT_APPLY = FIXTURES / "harness" / "layout_cannot_apply.py"


def test_a_harness_exception_is_an_error_row_and_the_next_item_runs(tmp_path):
    run = shardcheck(
        "run",
        "--suite-path",
        str(LAYOUT_CANNOT_APPLY),
        "--topology",
        "dp=1,cp=2,tp=1",
        "--dtype",
        "float64",
        out=tmp_path / "run",
        timeout=300,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    rows = run.rows
    bad = rows[rows["case_id"] == "output_cannot_be_laid_out"]
    assert list(bad["status"]) == ["error"], bad[["check", "status", "message"]]
    row = bad.iloc[0]
    assert row["symptom"] == "harness"
    assert row["error_type"] == "ValueError"
    assert "head-tail layout needs a length divisible by 2·CP = 4, got 6" in row["error_message"]
    # the line of shardcheck's own code that raised, not the op's (the op did nothing wrong)
    layout_py = (ROOT / "harness" / "core" / "layout.py").read_text().splitlines()
    path, line = row["error_where"].rsplit(":", 1)
    assert path == "harness/core/layout.py", row["error_where"]
    assert 'raise ValueError(f"head-tail layout needs' in layout_py[int(line) - 1]
    assert sorted(r["rank"] for r in row["per_rank"]) == [0, 1]  # every rank reported it, none died
    assert "a harness defect, not the op's" in row["message"]
    assert row["rerun"].startswith("shardcheck run ")
    # the next item ran on the same ranks and passes
    honest = rows[rows["case_id"] == "honest"]
    assert set(honest["check"]) == {"forward", "grad:x"} and (honest["status"] == "pass").all()
    assert "shardcheck's own fault, not the op's: ValueError" in run.stdout
    assert "raised at harness/core/layout.py:" in run.stdout


# ---- cases that know where they can run ------------------------------------------------------------------------


def test_layout_misfit_names_what_cannot_be_split():
    import torch
    from torch.distributed.tensor import Shard

    from shardcheck import HeadTail, Layout, PackedHeadTail

    seq = Layout(cp=HeadTail(1))
    assert seq.misfit((2, 32), {"cp": 16}) == ""
    assert seq.misfit((2, 16), {"cp": 16}) == "head-tail layout needs a length divisible by 2·CP = 32, got 16"
    assert seq.misfit((2, 16), {"cp": 1}) == ""  # CP 1: any length
    packed = Layout(cp=PackedHeadTail(0))
    bounds = {"cu_seqlens_padded": torch.tensor([0, 16, 24])}  # sequences of 16 and 8: the 8 splits up to CP 4
    assert packed.misfit((24,), {"cp": 4}, bounds) == ""
    assert packed.misfit((24,), {"cp": 8}, bounds) == "head-tail layout needs a length divisible by 2·CP = 16, got 8"
    vocab = Layout(dp=Shard(0), tp=Shard(-1))
    assert vocab.misfit((4, 3, 37), {"dp": 2, "tp": 8}) == ""  # uneven but never empty (5 × 7 + 2)
    why = vocab.misfit((4, 3, 33), {"dp": 2, "tp": 8})  # 5 × 6 + 3 + 0: the last TP rank holds nothing
    assert why.startswith("dim 2 of length 33 sharded over tp=8 leaves some ranks an empty piece"), why
    assert vocab.misfit((4, 3, 33), {"dp": 2, "tp": 8}, empty_pieces=("tp",)) == ""
    assert "dim 0 of length 4 sharded over dp=8" in vocab.misfit((4, 3, 37), {"dp": 8}, empty_pieces=("tp",))


def test_a_shard_over_cp_must_split_evenly_unless_the_case_tests_unequal_pieces():
    from torch.distributed.tensor import Shard

    from shardcheck import Layout

    contiguous = Layout(dp=Shard(0), cp=Shard(1), tp=Shard(-1))
    assert contiguous.misfit((4, 16, 24), {"cp": 4, "tp": 5}) == ""  # 16 over CP 4; 24 over TP 5 unequal, allowed
    why = contiguous.misfit((4, 16, 24), {"cp": 3})  # 6 + 5 + 5 positions: a CP op exchanges equal chunks
    assert why == (
        "dim 1 of length 16 sharded over cp=3 splits into unequal pieces, and the case does not test unequal "
        "pieces over cp"
    ), why
    assert contiguous.misfit((4, 16, 24), {"cp": 3}, uneven_pieces=("cp",)) == ""
    assert "over dp=3" in contiguous.misfit((4, 16, 24), {"dp": 3}, uneven_pieces=())
    # the length a later mesh dim splits is what the earlier ones left: 12 over DP 2 leaves 6, which CP 3 splits
    assert Layout(dp=Shard(1), cp=Shard(1)).misfit((2, 12), {"dp": 2, "cp": 3}) == ""
    assert "length 6 sharded over cp=4" in Layout(dp=Shard(1), cp=Shard(1)).misfit((2, 12), {"dp": 2, "cp": 4})


def test_the_plan_skips_a_contiguous_cp_shard_at_a_cp_that_does_not_divide_it():
    """`--world-sizes 3` on our own code: a case of 16 positions sharded Shard(1) over CP 3 was an error row
    ("sequence length 16 is not divisible by CP = 3"); it is a planned skip with the reason."""
    from shardcheck.harness.core.options import RunSettings
    from shardcheck.harness.driver.planner import Selection, build_plan

    plan = build_plan(
        Selection(
            run_id="t",
            settings=RunSettings(device="cpu", backend="gloo", timeout=60, seed=0),
            suites_wanted=["model_utils_cp"],
            case_patterns=["cp-shard1-*"],
            quick=True,
            world_sizes=[2, 3],
            dtypes=["float64"],
        )
    )
    by_cp = {i.topology[1]: i for i in plan.items if i.topology[1] > 1}
    assert not by_cp[2].skip
    assert "dim 1 of length 16 sharded over cp=3 splits into unequal pieces" in by_cp[3].skip, by_cp[3].skip


def test_cp_lengths_of_an_op_that_splits_by_itself():
    import torch

    from shardcheck import Case, Topology

    case = Case(
        op="f.op",
        case_id="c",
        make_inputs=lambda gen: {"x": torch.zeros(2)},
        reference=lambda x: x["x"],
        run=lambda impl, ctx, x: x["x"],
        context_parallel=True,
        cp_lengths=(24, 16),
    )
    assert case.misfit(Topology(1, 4, 1), {}) == ""
    assert case.misfit(Topology(1, 8, 1), {}) == (
        "a sequence of 24 cannot be split head-tail at dp1-cp8-tp1: the op needs a multiple of 2·CP = 16"
    )


def test_the_plan_skips_with_the_reason_what_a_case_cannot_lay_out():
    from shardcheck.harness.core.options import RunSettings
    from shardcheck.harness.driver.planner import Selection, build_plan

    plan = build_plan(
        Selection(
            run_id="t",
            settings=RunSettings(device="cpu", backend="gloo", timeout=60, seed=0),
            suites_wanted=["model_utils_cp"],
            ops=["model_utils.AllGatherCPTensor"],
            quick=True,
            world_sizes=[8, 16],
            dtypes=["float64"],
        )
    )
    by_cp = {}
    for item in plan.items:
        if item.case_id == "x2x3x32-seqdim2-sum_all":  # the scale case (S = 32): runs at CP 8 and 16, nowhere else
            assert not item.skip and item.topology[1] in (8, 16), item
            continue
        by_cp.setdefault(item.topology[1], []).append(item)
    assert not any(i.skip for cp, items in by_cp.items() if cp < 16 for i in items)  # S = 16 splits over 2·8
    at_16 = by_cp[16]
    assert at_16 and all(i.skip for i in at_16)
    assert all(
        "cannot be laid out at dp1-cp16-tp1: head-tail layout needs a length divisible by 2·CP = 32, got 16" in i.skip
        for i in at_16
    ), at_16[0].skip


def test_planned_skips_are_rows_with_their_reason_and_start_no_ranks(tmp_path):
    from shardcheck import Topology
    from shardcheck.harness.core.options import RunSettings
    from shardcheck.harness.core.records import RecordWriter, load
    from shardcheck.harness.driver.launch import run_plan
    from shardcheck.harness.driver.planner import Selection, build_plan

    class NoRanks:  # a pool that must not be asked for a launch
        run_dir = tmp_path  # (where the run's shared goldens would be kept)

        def take(self, *args):
            raise AssertionError("a launch was started for planned skips")

        standby = take

    plan = build_plan(
        Selection(
            run_id="t",
            settings=RunSettings(device="cpu", backend="gloo", timeout=60, seed=0),
            suites_wanted=["model_utils_cp"],
            ops=["model_utils.AllGatherCPTensor"],
            quick=True,
            case_patterns=["x2x3x16-*"],
            topologies=[Topology(1, 16, 1)],
            dtypes=["float64"],
        )
    )
    assert plan.items and all(i.skip for i in plan.items)
    writer = RecordWriter(tmp_path)
    run_plan(plan, tmp_path, writer, show_progress=False, pool=NoRanks())
    writer.close()
    rows = load(tmp_path)
    assert len(rows) == sum(len(i.checks) for i in plan.items) and (rows["status"] == "skip").all()
    assert rows["message"].str.contains("head-tail layout needs a length divisible by 2·CP = 32, got 16").all()


# ---- beyond one machine ----------------------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_node_torchrun_runs_a_plan_and_names_the_failing_item(tmp_path):
    """`torchrun --nnodes 2` as two agents on this machine over loopback (static rendezvous, as under SLURM), 2 ranks
    each, running the hand-launched worker on one plan: every node's ranks run the items, rank 0 (node 0) writes the
    records to the shared --out, exits 1 for the broken module, and the failing row's rerun line runs that item
    alone."""
    import os
    import shlex
    import subprocess
    import sys

    from shardcheck.harness.core.records import load

    out = tmp_path / "shared-out"  # both "nodes" see it, as an NFS folder under SLURM
    impl = BROKEN / "model_utils" / "one_rank_off.py"
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                "-m",
                "shardcheck.harness.standalone",
                "--suite",
                "model_utils",
                "--impl",
                f"model_utils={impl}",
                "--op",
                "model_utils.DistributedLogprob",
                "--case",
                "b2s5*",
                "--topology",
                "dp=1,cp=1,tp=4",
                "--topology",
                "dp=2,cp=1,tp=2",
                "--dtype",
                "float64",
                "--quick",
                "--timeout",
                "60",
                "--out",
                str(out),
            ],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    try:
        logs = [a.communicate(timeout=300)[0] for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    # torchrun exits with its first failed rank's code: rank 0's 1 (a check failed) on node 0; node 1's ranks are fine
    assert [a.returncode for a in agents] == [1, 0], "\n".join(log[-2000:] for log in logs)
    rows = load(out)
    assert set(zip(rows["dp"], rows["cp"], rows["tp"])) == {(1, 1, 4), (2, 1, 2)}
    assert set(rows["world_size"]) == {4}
    forward = rows[(rows["check"] == "forward") & (rows["tp"] == 4)].iloc[0]
    assert forward["status"] == "fail"
    assert forward["mismatch"]["rank"] == 1  # a rank of node 0; ranks 2 and 3 (node 1) reported their pieces too
    assert sorted(r["rank"] for r in forward["per_rank"]) == [0, 1, 2, 3]
    rerun = shlex.split(forward["rerun"])
    assert rerun[:2] == ["shardcheck", "run"] and "dp=1,cp=1,tp=4" in rerun and f"model_utils={impl}" in rerun
    again = shardcheck(*rerun[1:], out=tmp_path / "rerun", strict=False)
    assert again.returncode == 1, again.stdout + again.stderr
    bad = again.failed()
    assert set(zip(bad["case_id"], bad["check"])) == {(forward["case_id"], "forward")}
    assert bad.iloc[0]["mismatch"]["rank"] == 1


# ---- the scale matrix: CI's slice ------------------------------------------------------------------------------

# A few cases of each suite that run at 8 and 16 ranks: vocab shards at TP 8 and 16 (uneven, an empty one at TP 8),
# CP 8 and 16 head-tail layouts (CP 16 of a length-16 sequence: a planned skip), DP 8 and 16, the cp_utils context.
SCALE_SLICE = {
    "model_utils.DistributedLogprob": "b2s5v33-scale300.0-masked0.2",
    "model_utils.AllGatherCPTensor": "x2x3x16-seqdim2-sum_all",
    "model_utils._compute_distributed_log_softmax": "b2s3v6",  # a scale case: V = 6 < TP 8 and 16, most ranks empty
    "kd_loss.KDLoss": "plain-b2s8v32-T0.5-noupcast-mean-chunk4-masked",
    "cp_utils.make_cp_batch_and_ctx": "layout-b2s10-pad-masks",
    "distributed_utils.dp_eval_sample_shard": "ddp-n3",
}


def test_a_slice_of_the_scale_matrix_passes_at_8_and_16_ranks(tmp_path):
    run = shardcheck(
        "run",
        "--op",
        ",".join(SCALE_SLICE),
        *[a for c in SCALE_SLICE.values() for a in ("--case", c)],
        "--world-sizes",
        "8,16",
        "--dtype",
        "float64",
        "--quick",
        "--timeout",
        "300",
        out=tmp_path / "run",
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = run.rows
    assert set(rows["op"]) == set(SCALE_SLICE)
    assert set(rows["status"]) <= {"pass", "skip"}
    ran = rows[rows["status"] == "pass"]
    assert {8, 16} <= set(ran["world_size"])
    assert {(1, 1, 8), (1, 1, 16), (2, 1, 8), (1, 8, 1), (2, 8, 1), (8, 1, 1)} <= set(
        zip(ran["dp"], ran["cp"], ran["tp"])
    )
    # every rank of a 16-rank item reported (none died)
    assert ran[ran["tp"] == 16]["per_rank"].map(len).eq(16).all()
    skipped = rows[rows["status"] == "skip"]
    assert len(skipped) and skipped["message"].str.contains("cannot be laid out at dp1-cp16-tp1").all()
    # the scale case ran only at TP 8 and 16, every rank reporting its piece (6 of 8, 6 of 16 hold vocab entries)
    small_v = ran[ran["op"] == "model_utils._compute_distributed_log_softmax"]
    assert set(small_v["tp"]) == {8, 16} and small_v["per_rank"].map(len).eq(small_v["world_size"]).all()


def test_scale_cases_cover_cp_16_and_tp_8_and_leave_the_default_matrix_alone():
    """Every op planned at CP 8/16, TP 8/16 or DP 16 runs somewhere there (the scale cases), and none of the scale
    cases is planned at world sizes 1, 2, 4."""
    from shardcheck.harness.core.options import RunSettings
    from shardcheck.harness.driver.planner import Selection, build_plan

    def plan(**kw):
        return build_plan(
            Selection(
                run_id="t",
                settings=RunSettings(device="cpu", backend="gloo", timeout=60, seed=0),
                quick=True,
                dtypes=["float64"],
                **kw,
            )
        ).items

    scale = plan(world_sizes=[8, 16])
    for name, where in {
        "cp8": lambda t: t[1] == 8,
        "cp16": lambda t: t[1] == 16,
        "tp8": lambda t: t[2] == 8,
        "tp16": lambda t: t[2] == 16,
        "dp16": lambda t: t[0] == 16,
    }.items():
        uncovered = sorted(
            {i.op for i in scale if where(i.topology)} - {i.op for i in scale if where(i.topology) and not i.skip}
        )
        assert not uncovered, f"planned at {name} but never run there: {uncovered}"
    small_v = [i for i in scale if i.case_id == "b2s3v6" and i.op.endswith("_compute_distributed_log_softmax")]
    assert small_v and {i.topology[2] for i in small_v} == {8, 16}  # only where V = 6 < TP
    scale_ids = {(i.op, i.case_id) for i in scale} - {(i.op, i.case_id) for i in plan(world_sizes=[1, 2, 4])}
    assert {
        ("model_utils.AllGatherCPTensor", "x2x3x32-seqdim2-sum_all"),
        ("cp_utils.make_cp_batch_for_te", "scale-packs"),
        ("model_utils.all_to_all_sq2vp", "bs32v16"),
    } <= scale_ids


def test_a_layout_bug_at_cp_16_is_caught_by_the_scale_cases(tmp_path):
    """At CP 16 the matrix's S = 16 cases are planned skips: without the S = 32 scale cases a broken head-tail
    layout would pass there unseen.  Chunks taken in the wrong order fail `forward` on the scale case, named at CP
    16, with a rank's rerun line."""
    impl = BROKEN / "model_utils_cp" / "swapped_chunks.py"
    run = shardcheck(
        "run",
        "--suite",
        "model_utils_cp",
        "--impl",
        f"model_utils={impl}",
        "--op",
        "model_utils._get_tokens_on_this_cp_rank",
        "--topology",
        "dp=1,cp=16,tp=1",
        "--dtype",
        "float64",
        "--quick",
        "--timeout",
        "300",
        out=tmp_path / "run",
        timeout=900,
    )
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    rows = run.rows
    bad = run.failed()
    assert set(zip(bad["case_id"], bad["check"])) == {("x32x3x2-float-seqdim0", "forward")}, bad[["case_id", "check"]]
    row = bad.iloc[0]
    assert (row["dp"], row["cp"], row["tp"]) == (1, 16, 1)
    assert 0 <= row["mismatch"]["rank"] < 16 and "cp=16" in row["rerun"].replace(" ", "")
    # the S = 16 cases were skipped with their reason, not run
    skipped = rows[rows["status"] == "skip"]
    assert len(skipped) and skipped["message"].str.contains("the op needs a multiple of 2·CP = 32").all()
