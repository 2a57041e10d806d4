"""inbatch_neg_utils: the reference against direct formulas, the implementation without a process group,
the suite's placement on the default group (Case.world_group), the suite on the real implementation, and
the harness failing (with the right check and rank) on each module in tests/broken/inbatch_neg_utils/.

CLI runs are few and small: the quick suite once (world sizes 1, 2, 4: three launches, since the gathers
use the default group), then each broken module once at dp = 2, float64 (one 2-rank launch each).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import BROKEN

from shardcheck.distributed_impl import inbatch_neg_utils as impl
from shardcheck.harness.core.options import RunSettings
from shardcheck.reference import inbatch_neg_utils as ref

BROKEN_RUN = ("--suite", "inbatch_neg_utils", "--quick", "--dtype", "float64", "--topology", "dp=2", "--timeout", "120")
STEP_PRESERVE = "step-b4n4-d6x5-T0.5-preserve"
STEP_LOCAL = "step-b4n4-d6x5-T0.5-local-only-dp2"
STEP_GRADS = ("grad:weight", "grad:bias", "grad:query_features", "grad:passage_features")
MIN64 = torch.finfo(torch.float64).min


# ---- the reference and the implementation on one process ------------------------------------


def _scores(b, cols, seed=0, dtype=torch.float64):
    return torch.randn((b, cols), generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def test_reference_mask_by_hand():
    # 2 ranks x 2 queries x n = 2 passages; ids: query 0's positive (5) is also query 3's negative,
    # query 2's positive (9) appears again as query 0's negative and as query 3's positive.
    ids = torch.tensor([5, 9, 6, 7, 9, 1, 9, 5])
    scores = _scores(2, 8)
    got = ref.masked_scores(scores, ids, 2, 1, 2)  # rank 1: global queries 2, 3, positives at 4, 6
    want = scores.clone()
    want[0, [1, 6]] = MIN64  # query 2 (positive 9 at column 4): the other 9s
    want[1, [1, 4]] = MIN64  # query 3 (positive 9 at column 6): the other 9s
    assert torch.equal(got, want)
    rank0 = ref.masked_scores(scores, ids, 2, 0, 2)  # positives 0 (id 5) and 2 (id 6)
    want0 = scores.clone()
    want0[0, 7] = MIN64
    assert torch.equal(rank0, want0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 4])
def test_impl_mask_equals_reference_on_every_rank(dtype, n):
    from shardcheck.suites.inbatch_neg_utils import make_doc_ids

    b = 4
    ids = make_doc_ids(torch.Generator().manual_seed(3), b, n)
    full = _scores(b, b * n, seed=1, dtype=dtype)
    for dp in (1, 2, 4):
        b_local = b // dp
        for rank in range(dp):
            rows = full[rank * b_local : (rank + 1) * b_local].clone()
            impl.mask_gathered_passages_same_doc_as_positive(rows, ids, n, rank, b_local)
            want = ref.masked_scores(full, ids, n, 0, b)[rank * b_local : (rank + 1) * b_local]
            assert torch.equal(rows, want), (dp, rank)
            positives = (rank * b_local + torch.arange(b_local)) * n
            assert torch.equal(
                rows[torch.arange(b_local), positives],
                full[rank * b_local : (rank + 1) * b_local][torch.arange(b_local), positives],
            )  # the positive is never masked


def test_doc_ids_duplicate_across_ranks():
    from shardcheck.suites.inbatch_neg_utils import make_doc_ids

    for n in (1, 4):
        ids = make_doc_ids(torch.Generator().manual_seed(0), 4, n)
        for dp in (2, 4):
            per_rank = ids.view(dp, -1)
            # query 0's positive (rank 0) is also held by the last rank
            assert int(ids[0]) in per_rank[-1].tolist(), (n, dp)
        full = ref.masked_scores(_scores(4, 4 * n), ids, n, 0, 4)
        assert int((full == MIN64).sum()) == (2 if n == 1 else 5)  # the duplicates make_doc_ids places


def test_reference_padding_and_gather():
    a = torch.tensor([[1.0, 2.0]])
    b = torch.tensor([[3.0, 4.0, 5.0], [6.0, 7.0, 8.0]])
    got = ref.gather_with_dim1_padding([a, b], padding_value=-2.5)
    assert torch.equal(got, torch.tensor([[1.0, 2.0, -2.5], [3.0, 4.0, 5.0], [6.0, 7.0, 8.0]]))
    masks = ref.gather_with_dim1_padding([torch.tensor([[False]]), torch.tensor([[False, False]])], padding_value=True)
    assert masks.dtype == torch.bool and masks.tolist() == [[False, True], [False, False]]


def test_impl_without_process_group():
    """torch.distributed not initialised: None -> None, anything else comes back itself; bad shapes raise."""
    t = torch.randn(3, 2, requires_grad=True)
    assert impl.dist_gather_tensor(None) is None and impl.dist_gather_tensor_with_dim1_padding(None) is None
    assert impl.dist_gather_tensor(t) is t and impl.dist_gather_tensor(t, preserve_grad=True) is t
    assert impl.dist_gather_tensor_with_dim1_padding(t, padding_value=7, preserve_grad=True) is t
    with pytest.raises(ValueError):
        impl.dist_gather_tensor(torch.tensor(1.0))
    with pytest.raises(ValueError):
        impl.dist_gather_tensor_with_dim1_padding(torch.ones(3))
    with pytest.raises(ValueError):
        impl.mask_gathered_passages_same_doc_as_positive(torch.ones(2, 8), torch.arange(6), 4, 0, 2)


def _step_grads(fn, x):
    y = {k: v.clone().requires_grad_() if v.is_floating_point() else v for k, v in x.items()}
    loss = fn(y)
    loss.backward()
    return loss.detach(), {k: v.grad for k, v in y.items() if v.is_floating_point()}


def test_reference_contrastive_step():
    """The global loss is the mean cross entropy over all queries; local-only has the same value, its own
    gradient at dp > 1 (so the suite's local-only cases check something the preserve cases do not)."""
    from shardcheck.suites.inbatch_neg_utils import Step, _step_inputs

    step = Step(n=4)
    x = _step_inputs(step)(torch.Generator().manual_seed(0))
    args = lambda y: (y["query_features"], y["passage_features"], y["passage_doc_ids"], y["weight"], y["bias"], 4, 0.5)  # noqa: E731
    loss, grads = _step_grads(lambda y: ref.contrastive_loss(*args(y)), x)
    # by hand: scores of all queries against all passages, duplicates of each positive masked
    q = F.linear(x["query_features"], x["weight"], x["bias"])
    p = F.linear(x["passage_features"], x["weight"], x["bias"])
    scores = q @ p.T / 0.5
    for i in range(4):
        dup = x["passage_doc_ids"] == x["passage_doc_ids"][4 * i]
        dup[4 * i] = False
        scores[i, dup] = MIN64
    torch.testing.assert_close(loss, F.cross_entropy(scores, torch.arange(4) * 4), rtol=1e-12, atol=0)
    local1, grads1 = _step_grads(lambda y: ref.contrastive_loss_local_only(*args(y), dp=1), x)
    assert torch.equal(local1, loss) and all(torch.allclose(grads1[k], grads[k], rtol=1e-12) for k in grads)
    for dp in (2, 4):
        local, local_grads = _step_grads(lambda y, dp=dp: ref.contrastive_loss_local_only(*args(y), dp=dp), x)
        torch.testing.assert_close(local, loss, rtol=1e-12, atol=0)
        torch.testing.assert_close(local_grads["query_features"], grads["query_features"], rtol=1e-12, atol=1e-14)
        assert (local_grads["passage_features"] - grads["passage_features"]).abs().max() > 0.1
        assert (local_grads["weight"] - grads["weight"]).abs().max() > 0.1


# ---- placement on the default group (no launch) ---------------------------------------------


def _plan(world_sizes, topologies=()):
    from shardcheck.harness.driver.planner import Selection, build_plan

    return build_plan(
        Selection(
            run_id="t",
            suites_wanted=["inbatch_neg_utils"],
            ops=[],
            case_patterns=[],
            world_sizes=world_sizes,
            topologies=list(topologies),
            dtypes=["float64"],
            impl={},
            quick=True,
            settings=RunSettings(device="cpu", backend="gloo", timeout=60, seed=0),
        )
    )


def test_world_group_cases_run_in_a_launch_of_their_size():
    from shardcheck.harness.core.topology import Topology
    from shardcheck.suites.inbatch_neg_utils import MASK, cases

    gathering = [c for c in cases() if c.op != MASK]
    assert gathering and all(c.world_group for c in gathering)
    plan = _plan([1, 2, 4])
    placed = {True: set(), False: set()}
    for item in plan.items:
        placed[item.op == MASK].add((*item.topology, item.world_size))
    assert {(1, 1, 1, 1), (2, 1, 1, 2), (4, 1, 1, 4)} == placed[False]  # dp = world, cp = tp = 1
    # no collective: any launch would do; the default run gives every topology a launch of its own size
    assert {(1, 1, 1, 1), (2, 1, 1, 2), (4, 1, 1, 4)} == placed[True]
    # A worker started by hand on 4 ranks (world sizes [4], the topologies dividing 4): the gathers run at
    # dp 4 only; nothing is planned for a launch of 1 or 2 that would never come.
    by_hand = _plan([4], [Topology(1), Topology(2), Topology(4), Topology(2, 1, 2)])
    assert {i.world_size for i in by_hand.items} == {4}
    assert {i.topology for i in by_hand.items if i.op != MASK} == {(4, 1, 1)}
    assert {i.topology for i in by_hand.items if i.op == MASK} == {(1, 1, 1), (2, 1, 1), (4, 1, 1)}
    # --topology alone: its size is launched
    assert {(i.topology, i.world_size) for i in _plan(None, [Topology(2)]).items} == {((2, 1, 1), 2)}


def test_default_run_includes_the_suite():
    from shardcheck.harness.rank.suite_loader import suite_names

    assert "inbatch_neg_utils" in suite_names()
    plan = _plan(None)  # the default world sizes, as `shardcheck run` with no arguments
    assert {i.op for i in plan.items} >= {
        "inbatch_neg_utils.dist_gather_tensor",
        "inbatch_neg_utils.dist_gather_tensor_with_dim1_padding",
        "inbatch_neg_utils.mask_gathered_passages_same_doc_as_positive",
    }


# ---- the suite on the real implementation -------------------------------------------------------


def test_quick_suite_passes(run_shardcheck):
    run = run_shardcheck("run", "--suite", "inbatch_neg_utils", "--quick", "--world-sizes", "1,2,4", "--timeout", "120")
    assert run.returncode == 0, run.stdout + run.stderr
    rows = run.rows
    assert (rows["status"] == "pass").all(), run.failed()[["case_id", "check", "message"]]
    step = rows[rows["case_id"] == STEP_PRESERVE]
    for check in ("forward", *STEP_GRADS, "property:comm"):
        sel = step[step["check"] == check]
        assert set(sel["dp"]) == {1, 2, 4}, check
        assert {"float64", "float32", "bfloat16"} == set(sel["dtype"]), check
    assert (step["world_size"] == step["dp"]).all()
    # the DP > 1 step moves its passages once each way (checked tight by property:comm)
    comm = step[(step["check"] == "property:comm") & (step["dp"] == 2) & (step["dtype"] == "float64")].iloc[0]
    assert comm["comm_calls"] == {
        "forward": {"all_gather@dp": 2},
        "backward": {"all_reduce@dp": 2, "reduce_scatter@dp": 1},
    }
    assert set(rows[rows["case_id"] == STEP_LOCAL]["dp"]) == {2}
    mask = rows[rows["op"] == "inbatch_neg_utils.mask_gathered_passages_same_doc_as_positive"]
    kept = mask[mask["check"] == "property:positive_kept"]
    assert set(kept["dp"]) == {1, 2, 4} and {"bfloat16", "float32"} <= set(kept["dtype"])
    assert len(rows[rows["check"] == "property:bad_input"])
    assert len(rows[rows["check"].str.startswith("property:unchanged:")]) == 5


# ---- broken implementations ---------------------------------------------------------------------


def _run_broken(run_shardcheck, name):
    run = run_shardcheck("run", *BROKEN_RUN, "--impl", f"inbatch_neg_utils={BROKEN / 'inbatch_neg_utils' / name}.py")
    assert run.returncode == 1, run.stdout + run.stderr
    return run


def _bad(rows):
    return {(r.case_id, r.check) for r in rows[rows["status"] != "pass"].itertuples()}


def _row(rows, case_id, check):
    sel = rows[(rows["case_id"] == case_id) & (rows["check"] == check)]
    assert len(sel) == 1, (case_id, check)
    return sel.iloc[0]


def _failing_ranks(row):
    return {r["rank"] for r in row["per_rank"] if r["status"] == "fail"}


def test_broken_remote_detached(run_shardcheck):
    run = _run_broken(run_shardcheck, "remote_detached")
    rows = run.rows
    assert _bad(rows) == {(STEP_PRESERVE, c) for c in ("grad:weight", "grad:bias", "grad:passage_features")} | {
        ("float-b4h3-preserve", "grad:t")
    }
    row = _row(rows, STEP_PRESERVE, "grad:passage_features")
    assert _failing_ranks(row) == {0, 1}  # both ranks' passages miss the other rank's loss
    assert "grad:passage_features" in run.stdout
    # the gathered copy's gradient from the other rank's loss is missing: half the summed upstream
    row = _row(rows, "float-b4h3-preserve", "grad:t")
    assert row["mismatch"]["got"] != pytest.approx(row["mismatch"]["expected"], rel=1e-6)


def test_broken_mask_no_rank_offset(run_shardcheck):
    run = _run_broken(run_shardcheck, "mask_no_rank_offset")
    rows = run.rows
    row = _row(rows, "b4n4", "forward")
    assert row["status"] == "fail" and _failing_ranks(row) == {1}  # rank 0's offset is 0
    assert row["mismatch"]["coords"]["dp"] == 1 and "failing rank(s): 1" in row["message"]
    assert _row(rows, STEP_PRESERVE, "forward")["status"] == "fail"
    assert _row(rows, STEP_LOCAL, "forward")["status"] == "fail"
    assert all(case_id.startswith("step-") or case_id == "b4n4" for case_id, _ in _bad(rows))


def test_broken_positive_masked(run_shardcheck):
    run = _run_broken(run_shardcheck, "positive_masked")
    rows = run.rows
    row = _row(rows, "b4n4", "property:positive_kept")
    assert row["status"] == "fail" and _failing_ranks(row) == {0, 1}
    assert "positive column(s)" in row["message"] and "property:positive_kept" in run.stdout
    assert _row(rows, "b4n4", "forward")["status"] == "fail"
    assert _row(rows, STEP_PRESERVE, "forward")["status"] == "fail"


def test_broken_padding_ignores_value(run_shardcheck):
    run = _run_broken(run_shardcheck, "padding_ignores_value")
    rows = run.rows
    float_case, bool_case = "float-b4L3.2.5.1h2-pad-2.5-preserve", "bool-b4L2.4.1.3-padTrue"
    assert _bad(rows) == {(float_case, "forward"), (bool_case, "forward")}
    row = _row(rows, float_case, "forward")
    # rank 0 holds rows of length 3, 2 and pads them to the longest (5): zeros instead of -2.5
    assert row["mismatch"]["expected"] == -2.5 and row["mismatch"]["got"] == 0.0
    assert row["mismatch"]["global_index"][1] >= 3
    assert "expected True, got False" in _row(rows, bool_case, "forward")["message"]


def test_broken_local_slice_detached(run_shardcheck):
    run = _run_broken(run_shardcheck, "local_slice_detached")
    rows = run.rows
    bad = _bad(rows)
    assert {(STEP_LOCAL, c) for c in ("grad:weight", "grad:bias", "grad:passage_features")} <= bad
    assert ("float-b4h3-local-only", "grad:t") in bad
    assert all(case_id in (STEP_LOCAL, "float-b4h3-local-only") for case_id, _ in bad)  # preserve_grad is right
    assert "no gradient reached input 'passage_features'" in _row(rows, STEP_LOCAL, "grad:passage_features")["message"]
    # a crash in the direct case, wrong gradients in the step: one cause, told apart by what triggers both
    (cause,) = run.causes.itertuples()
    assert cause.condition.startswith("exactly") and "with preserve_grad = False" in cause.condition, cause.condition


def test_broken_grad_averaged(run_shardcheck):
    run = _run_broken(run_shardcheck, "grad_averaged")
    rows = run.rows
    assert {(STEP_PRESERVE, "grad:passage_features"), ("float-b4h3-preserve", "grad:t")} <= _bad(rows)
    row = _row(rows, "float-b4h3-preserve", "grad:t")
    assert row["mismatch"]["got"] == pytest.approx(row["mismatch"]["expected"] / 2, rel=1e-9)  # 1/dp of the sum
    assert _row(rows, STEP_PRESERVE, "forward")["status"] == "pass"
