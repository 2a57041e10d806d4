"""Expert parallelism (the `ep` axis: a part of dp, harness/core/topology.py) and the `moe` family: topologies and
layouts over ep, the reference's router, dispatch, combine and load-balancing loss, our module at every ep of the
world sizes, each broken plan (tests/broken/moe) one finding naming the expert parameter, the module or the loss, and
bad ep values one line with exit 2."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest
import torch
from helpers import BROKEN, IMPLS, ROOT, assert_one_cause
from torch.distributed.tensor import Partial, Shard

from shardcheck.harness.core.case import Case
from shardcheck.harness.core.layout import Layout
from shardcheck.harness.core.options import UsageError
from shardcheck.harness.core.records import load
from shardcheck.harness.core.topology import Topology, expert_topologies
from shardcheck.reference import moe as ref

OURS = ("run", "--suite", "moe", "--dtype", "float64,bfloat16")
EP_TOPOLOGIES = ("--topology", "dp=4,ep=2", "--topology", "dp=4,ep=4", "--topology", "dp=2,ep=2,tp=2")


def _broken(bug: str) -> str:
    return f"moe={BROKEN / 'moe' / bug}.py"


# ---- without ranks -------------------------------------------------------------------------------------------------


def test_ep_is_part_of_dp_and_named_only_when_used():
    assert Topology.parse("dp=4,ep=2") == Topology(4, 1, 1, ep=2)
    assert str(Topology(4, 1, 1, ep=2)) == "dp4-ep2-cp1-tp1" and str(Topology(2, 1, 2)) == "dp2-cp1-tp2"
    assert Topology(4, 1, 1, ep=2).size == 4  # borrowed from dp: no ranks of its own
    with pytest.raises(UsageError, match="ep=2 must divide dp=3"):
        Topology.parse("dp=3,ep=2")
    assert expert_topologies([1, 2, 4]) == [
        Topology(2, 1, 1, 2),
        Topology(4, 1, 1, 2),
        Topology(4, 1, 1, 4),
        Topology(2, 2, 1, 2),
        Topology(2, 1, 2, 2),
    ]


def test_an_ep_layout_splits_over_ep_and_leaves_dp_the_rest():
    sizes = {"dp": 4, "ep": 2, "cp": 1, "tp": 2}
    experts = Layout(ep=Shard(0), tp=Shard(2))
    # dp rank d: ep coordinate d % 2 (ep innermost), the same experts on dp ranks 0 and 2
    pieces = [experts.indices((4, 3, 6), {"dp": d, "tp": 1}, sizes) for d in range(4)]
    assert [p[0].tolist() for p in pieces] == [[0, 1], [2, 3], [0, 1], [2, 3]]
    assert pieces[0][2].tolist() == [3, 4, 5]
    # [E, T, D] rows: experts over ep, tokens over the rest of dp (edp = dp // ep)
    rows = Layout(dp=Shard(1), ep=Shard(0))
    assert [rows.indices((4, 8), {"dp": d}, sizes)[1].tolist() for d in range(4)] == [
        [0, 1, 2, 3],
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [4, 5, 6, 7],
    ]
    assert "ep=3" in experts.misfit((8, 3, 6), {"dp": 3, "ep": 3})
    assert repr(Layout(dp=Partial(), ep=Shard(0))).endswith("ep=S(0))")
    with pytest.raises(ValueError, match="Shard"):
        Layout(ep=Partial())


def test_only_cases_that_declare_expert_parallelism_get_ep_topologies():
    def case(**kw) -> Case:
        return Case(op="f.op", case_id="c", make_inputs=dict, reference=lambda x: x, run=lambda i, c, x: x, **kw)

    assert not case().runs_on(Topology(2, 1, 1, ep=2)) and case().runs_on(Topology(2, 1, 1))
    assert case(expert_parallel=True).runs_on(Topology(2, 1, 1, ep=2))


def test_the_reference_routes_renormalized_and_combines_what_it_dispatched():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    x = torch.randn(6, 3, generator=gen, dtype=torch.float64)
    weights, experts = ref.route(logits, 2)
    torch.testing.assert_close(weights.sum(-1), torch.ones(6, dtype=torch.float64))
    probs = logits.softmax(-1)
    torch.testing.assert_close(
        weights[:, 0] / weights[:, 1], probs.gather(1, experts[:, :1])[:, 0] / probs.gather(1, experts[:, 1:])[:, 0]
    )
    dense = ref.dispatch(x, experts, 5)
    assert dense.shape == (5, 6, 3) and int((dense.abs().sum(-1) > 0).sum()) == 12
    torch.testing.assert_close(ref.combine(dense, weights, experts), x)  # weights sum to 1: each token back
    # E * sum_e f_e P_e, f_e over the 12 assignments
    counts = torch.bincount(experts.reshape(-1), minlength=5).double()
    want = 5 * (counts / 12 * probs.mean(0)).sum()
    torch.testing.assert_close(ref.aux_loss(logits, experts, 5), want)


def test_the_model_routes_every_token_id_with_a_margin():
    cfg = ref.Config()
    model = ref.build(cfg, torch.Generator().manual_seed(5))
    normed = model.layer.ffn_norm(model.tok_embeddings.weight)
    assert ref.routing_margin(model.layer.moe.router(normed), cfg.top_k) >= ref.MIN_MARGIN


# ---- runs ----------------------------------------------------------------------------------------------------------


def test_our_moe_passes_at_every_ep_with_rows_naming_it(shared_run):
    run = shared_run(*OURS, *EP_TOPOLOGIES)
    assert run.returncode == 0, run.stdout[-3000:]
    rows = run.rows
    assert set(zip(rows["dp"], rows["ep"], rows["tp"])) == {(4, 2, 1), (4, 4, 1), (2, 2, 2)}
    assert set(rows["op"]) == {"moe.route", "moe.dispatch", "moe.combine", "moe.aux_loss", "moe.parallelize"}
    model = rows[rows["op"] == "moe.parallelize"]
    # each rank's experts against their slice of the single-device ones
    assert {"forward:dparam:layer.moe.experts.w1", "forward:step:layer.moe.experts.w2"} <= set(model["check"])
    assert set(model["dtype"]) == {"float64", "bfloat16"}


@pytest.mark.parametrize(
    "bug, topologies, named",
    [
        ("expert_grad_not_divided_by_ep", ("dp=2", "dp=4,ep=2"), "parameter layer.moe.experts.w1 (gradient)"),
        ("expert_tp_grad_synced_over_tp", ("dp=2", "dp=2,tp=2"), "parameter layer.moe.experts.w1 (gradient)"),
        ("aux_loss_over_ep_group", ("dp=2,ep=2", "dp=4,ep=2"), "the loss [forward:loss]"),
        ("combine_unpermutes_in_wrong_order", ("dp=2,ep=2",), "module layer.moe (output, forward)"),
    ],
)
def test_each_broken_plan_is_one_finding_naming_its_place(run_shardcheck, bug, topologies, named):
    args = ["run", "--suite", "moe", "--op", "moe.parallelize", "--case", "decoder", "--dtype", "float64"]
    run = run_shardcheck(*args, *[a for t in topologies for a in ("--topology", t)], "--impl", _broken(bug))
    assert run.returncode == 1, run.stdout[-3000:]
    cause = assert_one_cause(run)
    assert f"first diverging: {named}" in run.stdout and cause.op == "moe.parallelize", run.stdout[-3000:]
    failed = run.failed()
    assert len(failed.drop_duplicates(["dp", "ep", "cp", "tp"])) == 1  # the one topology the bug shows at
    if bug == "expert_grad_not_divided_by_ep":  # its rerun line reproduces it alone
        rerun = shlex.split(failed["rerun"].iloc[0])
        assert "dp=4,cp=1,tp=1,ep=2" in rerun
        again = run_shardcheck(*rerun[1:])
        assert again.returncode == 1 and set(again.failed()["ep"]) == {2}


def test_the_combine_op_case_catches_the_wrong_order_too(run_shardcheck):
    args = ("run", "--suite", "moe", "--op", "moe.combine", "--topology", "dp=2,ep=2", "--dtype", "float64")
    run = run_shardcheck(*args, "--impl", _broken("combine_unpermutes_in_wrong_order"))
    assert run.returncode == 1 and set(run.failed()["op"]) == {"moe.combine"}, run.stdout[-3000:]
    assert_one_cause(run)
    # the failing rank named with its expert-parallel coordinates (dp rank 1: ep 1, edp 0)
    assert "rank 1 (dp=1, ep=1, edp=0, cp=0, tp=0)" in run.failed()["message"].iloc[0], run.stdout[-3000:]


@pytest.mark.parametrize(
    "args, says",
    [
        (("--suite", "moe", "--topology", "dp=3,ep=2"), "ep=2 must divide dp=3"),
        (("--suite", "moe", "--topology", "dp=3,ep=3"), "ep=3 does not divide the 8 experts of moe."),
        (("--suite", "kd_loss", "--topology", "dp=2,ep=2"), "no selected case runs expert parallelism"),
    ],
)
def test_a_bad_ep_is_one_line_and_exit_2(run_shardcheck, args, says):
    run = run_shardcheck("run", *args, strict=False)
    assert run.returncode == 2 and says in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_a_hang_on_an_ep_or_edp_group_is_lined_up_among_its_own_ranks():
    from shardcheck.harness.driver.flight import members

    # dp 4, tp 2, ep 2: rank 3 is dp 1 (ep 1, edp 0), tp 1
    assert members("ep", 3, (4, 1, 2, 2)) == [1, 3]
    assert members("edp", 3, (4, 1, 2, 2)) == [3, 7]
    assert members("dp", 3, (4, 1, 2, 2)) == [1, 3, 5, 7] == members("dp", 3, (4, 1, 2))


def test_the_hand_launched_worker_runs_the_ep_topologies_of_its_world(tmp_path):
    out = tmp_path / "by-hand"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["-m", "shardcheck.harness.standalone", "--op", "moe.dispatch", "--op", "moe.aux_loss"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [*command, "--dtype", "float64", "--strict", "--out", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = load(out)
    assert set(zip(rows["dp"], rows["ep"])) == {(1, 1), (2, 1), (2, 2)} and (rows["status"] == "pass").all()


def test_experts_held_as_dtensors_on_the_expert_mesh_are_laid_out_by_their_placements(run_shardcheck):
    impl = f"moe={IMPLS / 'dtensor_experts_moe.py'}"
    args = ("run", "--suite", "moe", "--op", "moe.parallelize", "--case", "decoder", "--dtype", "float64")
    run = run_shardcheck(*args, "--topology", "dp=2,ep=2,tp=2", "--impl", impl)
    assert run.returncode == 0, run.stdout[-3000:]
    assert {"forward:dparam:layer.moe.experts.w1", "forward:step:layer.moe.experts.w2"} <= set(run.rows["check"])
