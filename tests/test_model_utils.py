"""The model_utils suite (TP axis): it passes the real implementation (TP 2, 4 and 8) and fails each module
under tests/broken/model_utils/ (one deliberate bug each) on the right check, naming a rank that really is
wrong.  Small runs: --quick, float64 (the sharp check) for the bugs.
"""

from __future__ import annotations

import pytest
import torch
from helpers import BROKEN, IMPLS
from hypothesis import HealthCheck, Phase, given, seed, settings

from shardcheck.harness.core.topology import default_topologies
from shardcheck.suites import model_utils as suite
from shardcheck.suites._model_utils_inputs import Draw

NEW_OPS = [
    "DistributedLogprobWithSampling",
    "ChunkedDistributedLogprobWithSampling",
    "ChunkedDistributedGatherLogprob",
    "distributed_vocab_topk",
    "gather_logits_at_global_indices",
    "get_distillation_topk_logprobs_from_logits",
    "ChunkedDistributedEntropy",
    "from_parallel_hidden_states_to_logprobs",
    "ChunkedDistributedHiddenStatesToLogprobs",
    "from_parallel_logits_to_logprobs",
    "get_logprobs_from_vocab_parallel_logits",
    "get_next_token_logprobs_from_logits",
    "dtensor_from_parallel_logits_to_logprobs",
]


def _ops(names) -> tuple[str, str]:
    return ("--op", ",".join(f"model_utils.{n}" for n in names))


def _topology(tp: int) -> tuple[str, str]:
    return ("--topology", f"dp=1,cp=1,tp={tp}")


@pytest.mark.parametrize(
    "module, op, check, ranks",
    [
        # offset bug lives on the ranks whose vocab does not start at 0: rank 1's gradient is wrong
        ("wrong_vocab_offset", "DistributedLogprob", "grad:logits", {1}),
        # local max: every rank's log-softmax is off
        ("missing_max_allreduce", "_compute_distributed_log_softmax", "forward", {0, 1}),
        # values right, gradients doubled on every TP rank
        ("grad_scaled_by_tp", "DistributedLogprob", "grad:logits", {0, 1}),
        # only TP rank 1 returns different values
        ("one_rank_off", "DistributedLogprob", "forward", {1}),
        # positions of the last partial chunk are never computed
        ("dropped_last_chunk", "ChunkedDistributedLogprob", "forward", {0, 1}),
    ],
)
def test_wrong_values_are_caught(run_shardcheck, module, op, check, ranks):
    run = run_shardcheck(
        "run",
        "--impl",
        f"model_utils={BROKEN / 'model_utils' / module}.py",
        "--op",
        f"model_utils.{op}",
        *_topology(2),
        "--dtype",
        "float64",
        "--quick",
    )
    assert run.returncode == 1, run.stdout + run.stderr
    bad = run.failed()
    assert set(bad["op"]) == {f"model_utils.{op}"}
    rows = bad[bad["check"] == check]
    assert len(rows), f"{check} did not fail: {bad[['case_id', 'check', 'message']]}"
    assert (rows["status"] == "fail").all()
    # every failing row names a rank that really is wrong, with where and what
    for _, row in rows.iterrows():
        assert row["mismatch"]["rank"] in ranks
        assert row["mismatch"]["global_index"] is not None and row["mismatch"]["local_index"] is not None
        failing = {r["rank"] for r in row["per_rank"] if r["status"] == "fail"}
        assert failing <= ranks and failing
        assert f"rank {row['mismatch']['rank']} (dp=0, cp=0, tp={row['mismatch']['rank']})" in row["message"]
    # the failure is about sharding, not noise: far above the float64 budget
    assert (rows["err_ratio"].fillna(float("inf")) > 100).all()
    assert "FAIL" in run.stdout


@pytest.mark.parametrize(
    "module, op, checks, numeric",
    [
        # top-p on the full distribution, then top-k: the "both" case differs in values and gradients
        ("top_p_before_top_k", "DistributedLogprobWithSampling", ["forward", "grad:logits"], True),
        # ids of TP rank 1's candidates in local numbering: repeated / wrong ids (the values stay right)
        ("topk_local_ids", "distributed_vocab_topk", ["forward:ids"], False),
        # duplicate gather indices: only the last one's g_k lands in the gradient
        ("gather_dup_no_accumulate", "ChunkedDistributedGatherLogprob", ["grad:logits"], True),
        # Shannon entropy instead of sum p log p: values, gradient and the H <= 0 property
        (
            "entropy_wrong_sign",
            "ChunkedDistributedEntropy",
            ["forward", "grad:logits", "property:entropy_nonpositive"],
            True,
        ),
        # weight gradient times TP: only grad:weight is wrong
        ("hidden_weight_grad_scaled", "ChunkedDistributedHiddenStatesToLogprobs", ["grad:weight"], True),
    ],
)
def test_broken_modules_fail_on_the_right_check(run_shardcheck, module, op, checks, numeric):
    impl = BROKEN / "model_utils" / f"{module}.py"
    run = run_shardcheck(
        "run",
        "--impl",
        f"model_utils={impl}",
        "--op",
        f"model_utils.{op}",
        "--quick",
        "--dtype",
        "float64",
        *_topology(2),
    )
    assert run.returncode == 1, run.stdout + run.stderr
    bad = run.failed()
    assert set(bad["op"]) == {f"model_utils.{op}"}
    assert set(bad["check"]) == set(checks), bad[["case_id", "check", "message"]].to_string()
    assert (bad["status"] == "fail").all(), bad[["case_id", "check", "message"]].to_string()
    for _, row in bad.iterrows():
        rank = row["mismatch"]["rank"]
        failing = {r["rank"] for r in row["per_rank"] if r["status"] == "fail"}
        # every bug here reaches both TP ranks (replicated outputs, or each rank's own shard)
        assert rank in failing and failing == {0, 1}, row["message"]
        assert row["message"].startswith(f"rank {rank} (dp=0, cp=0, tp={rank})"), row["message"]
        if numeric and not row["check"].startswith("property:"):
            assert row["mismatch"]["global_index"] is not None
            assert row["err_ratio"] > 100  # a sharding bug, not rounding
    assert "FAIL" in run.stdout


def test_gather_logprob_gradient_at_v1_is_zero_to_the_round_off_of_its_upstream_gradients(run_shardcheck):
    """V = 1: the softmax is exactly 1 and every id repeats, so the gather log-prob's gradient is exactly 0 (the
    golden's too).  Ours gives that 0 at TP 1 and 2 (rank 1: an empty shard) in every dtype; a backward that adds the
    g_k after subtracting their sum leaves a rounding residue of the upstream gradients' scale, within the floor a
    golden of exact zeros gets from it (issue 42, item 5); a backward that drops repeated ids is wrong, and caught."""
    case = ("--op", "model_utils.ChunkedDistributedGatherLogprob", "--case", "b2s4v1-*")
    ours = run_shardcheck("run", *case, *_topology(1), *_topology(2))
    assert ours.returncode == 0, ours.stdout + ours.stderr
    assert set(ours.rows["tp"]) == {1, 2} and "grad:logits" in set(ours.rows["check"])
    assert (ours.rows["status"] == "pass").all()

    residue = run_shardcheck(
        "run",
        "--impl",
        f"model_utils={IMPLS / 'gather_grad_residue_model_utils.py'}",
        *case,
        *_topology(1),
        "--dtype",
        "float32",
    )
    assert residue.returncode == 0, residue.stdout + residue.stderr
    grad = residue.rows[residue.rows["check"] == "grad:logits"]
    assert len(grad) == 1 and 0 < grad["err_ratio"].iloc[0] < 1, grad[["err_ratio", "budget", "message"]]

    dropped = run_shardcheck(
        "run",
        "--impl",
        f"model_utils={BROKEN / 'model_utils' / 'gather_dup_no_accumulate.py'}",
        *case,
        *_topology(1),
        "--dtype",
        "float64,float32",
    )
    assert dropped.returncode == 1, dropped.stdout + dropped.stderr
    bad = dropped.failed()
    assert set(bad["check"]) == {"grad:logits"} and (bad["status"] == "fail").all(), bad["message"].tolist()
    assert set(bad["dtype"]) == {"float64", "float32"}
    for _, row in bad.iterrows():
        assert row["message"].startswith("rank 0 (dp=0, cp=0, tp=0)"), row["message"]
        assert row["mismatch"]["expected"] == 0 and abs(row["mismatch"]["got"]) > 1e-3, row["mismatch"]


def _drawn(op: str, n: int = 60) -> list[dict]:
    """n params the op's fuzz space draws (seed 0), as `shardcheck fuzz` draws them."""
    space, out = {s.op: s for s in suite.fuzz_spaces()}[f"model_utils.{op}"], []

    @seed(0)
    @settings(
        max_examples=n, database=None, phases=[Phase.generate], deadline=None, suppress_health_check=list(HealthCheck)
    )
    @given(space.params(default_topologies([1, 2, 4])))
    def collect(params):
        out.append(params)

    collect()
    return out


def test_spaces_stay_where_the_checks_can_judge():
    """What the model_utils fuzz spaces leave out, and why (suites/model_utils.py): next-token ops draw S >= 2 (a
    one-token target raises), hidden states at scale 10 only in float64 (the low-precision projection's rounding,
    amplified in almost one-hot rows, is beyond the per-row budget), and the cross entropy with huge logits draws
    them for the student only (q - p of two one-hot rows is all rounding) and puts each student -inf on the target
    too (the rows stay finite)."""
    for op in (
        "from_parallel_logits_to_logprobs",
        "from_parallel_hidden_states_to_logprobs",
        "get_logprobs_from_vocab_parallel_logits",
        "get_next_token_logprobs_from_logits",
        "dtensor_from_parallel_logits_to_logprobs",
    ):
        sizes = {p["S"] for p in _drawn(op)}
        assert min(sizes) == 2, (op, sorted(sizes))
    for op in ("ChunkedDistributedHiddenStatesToLogprobs", "from_parallel_hidden_states_to_logprobs"):
        huge = [p["dtype"] for p in _drawn(op) if p["scale"] == 10.0]
        assert huge and set(huge) == {"float64"}, (op, huge)

    def ce_inputs(scale: float) -> dict[str, torch.Tensor]:
        case = suite.cross_entropy_case(suite.Shape(2, 5, 33, Draw(scale=scale, neg_inf=0.5)))
        return case.make_inputs(torch.Generator().manual_seed(0))

    x = ce_inputs(300.0)
    student_inf = x["student_logits"].isneginf()
    assert student_inf.any() and x["target_logits"][student_inf].isneginf().all()
    assert x["target_logits"][~student_inf].isfinite().all()
    assert x["target_logits"][~student_inf].abs().max() < 30  # the target at the usual scale: p is never one-hot
    x = ce_inputs(3.0)  # usual logits: p > 0 in every dtype, so a student -inf gives H = +inf everywhere
    assert x["student_logits"].isneginf().any() and x["target_logits"].isfinite().all()


def test_new_ops_pass_at_tp2_and_tp4(run_shardcheck):
    run = run_shardcheck("run", *_ops(NEW_OPS), "--quick", *_topology(2), *_topology(4))
    assert run.returncode == 0, run.stdout + run.stderr
    rows = run.rows
    assert (rows["status"] == "pass").all()
    for op in NEW_OPS:  # every op really ran on both layouts, in every default dtype
        mine = rows[rows["op"] == f"model_utils.{op}"]
        assert set(mine["tp"]) == {2, 4}, op
        assert set(mine["dtype"]) == {"float64", "float32", "bfloat16"}, op
    checks = set(rows["check"])
    for prop in ("survivors_sum_to_1", "chunked_equals_unchunked", "entropy_nonpositive", "bad_input"):
        assert f"property:{prop}" in checks
    # filtered-out targets are -inf and matched exactly; H_all=None is checked as None
    assert {"forward:ids", "forward:values", "forward:H_all", "grad:weight", "grad:hidden"} <= checks


def test_every_new_op_runs_at_tp8(run_shardcheck):
    """World size 8 oversubscribes a 2-core machine: --quick, float64 only (about 22 s there)."""
    run = run_shardcheck("run", *_ops(NEW_OPS), "--quick", "--dtype", "float64", *_topology(8))
    assert run.returncode == 0, run.stdout + run.stderr
    rows = run.rows
    assert set(rows["tp"]) == {8}
    assert set(rows["op"]) == {f"model_utils.{op}" for op in NEW_OPS}  # every op has a case that fits TP 8
    assert (rows["status"] == "pass").all()


def test_empty_vocab_shard_keeps_the_gradient(run_shardcheck):
    """V = 6 at TP 4 leaves rank 3 an empty vocab shard: our gather and hidden-states ops pass there (rank 3's
    backward once raised in both), and an implementation whose empty shard hands back detached zeros for the
    gathered logits fails on rank 3 alone."""
    ops = ("gather_logits_at_global_indices", "ChunkedDistributedHiddenStatesToLogprobs")
    at_tp4 = ("--case", "*v6-*", *_topology(4), "--dtype", "float64")
    ours = run_shardcheck("run", *_ops(ops), *at_tp4)
    assert ours.returncode == 0, ours.stdout + ours.stderr
    assert set(ours.rows["op"]) == {f"model_utils.{op}" for op in ops}
    assert {"grad:logits", "grad:hidden", "grad:weight"} <= set(ours.rows["check"])
    assert (ours.rows["status"] == "pass").all()

    broken = run_shardcheck(
        "run", "--impl", f"model_utils={BROKEN / 'model_utils' / 'empty_shard_detached.py'}", *_ops(ops[:1]), *at_tp4
    )
    assert broken.returncode == 1, broken.stdout + broken.stderr
    bad = broken.failed()
    grad = bad[bad["check"] == "grad:logits"].iloc[0]
    assert grad["status"] == "error" and grad["error_type"] == "RuntimeError", grad["message"]
    assert grad["message"].startswith("rank 3 (dp=0, cp=0, tp=3): RuntimeError"), grad["message"]
    assert {r["rank"] for r in grad["per_rank"] if r["status"] == "error"} == {3}
    assert set(bad["check"]) <= {"grad:logits", "property:comm"}  # the forward is right on every rank
