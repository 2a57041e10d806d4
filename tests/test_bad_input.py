"""Bad input, "loud or right": a case feeding input outside the op's contract passes when the op raises (any
exception, recorded; a type other than the one the seed documents is a warning) or returns the documented
interpretation's answer, and fails on a silent return or a wrong answer."""

from __future__ import annotations

from helpers import BROKEN, IMPLS

from shardcheck.harness.core.bad_input import BadInput


def test_any_exception_passes_and_an_undocumented_type_warns_only_where_the_seed_names_one():
    assert BadInput("shapes").judge_raise(AssertionError("differ")) == ("pass", "raised AssertionError: differ")
    assert BadInput("no seq_lens", documented=(KeyError,)).judge_raise(KeyError("seq_lens")) == (
        "pass",
        "raised KeyError: 'seq_lens'",
    )
    status, message = BadInput("no seq_lens", documented=(KeyError,)).judge_raise(RuntimeError("boom"))
    assert status == "warn" and message == "raised RuntimeError: boom; the seed documents KeyError for no seq_lens"


def test_another_exception_type_and_a_correct_padding_pass(run_shardcheck):
    """AssertionError where ours raises ValueError; B·S rows padded to a multiple of TP, values and gradients right."""
    run = run_shardcheck(
        "run",
        "--impl",
        f"model_utils={IMPLS / 'loud_or_padded_model_utils.py'}",
        "--op",
        "model_utils.DistributedCrossEntropy",
        "--op",
        "model_utils.DistributedLogprobWithSampling",
        "--case",
        "shape-mismatch",
        "--case",
        "b1s3v16-bs-not-divisible",
        "--topology",
        "dp=1,cp=1,tp=2",
        "--dtype",
        "float64",
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = run.rows.set_index(["op", "check"])
    raised = rows.loc[("model_utils.DistributedCrossEntropy", "property:bad_input")]
    assert raised["status"] == "pass" and raised["message"].startswith("raised AssertionError")
    padded = rows.loc["model_utils.DistributedLogprobWithSampling"]
    assert sorted(padded.index) == ["forward", "grad:logits"] and (padded["status"] == "pass").all()


def test_a_sequence_padded_inside_the_cp_context_passes_on_the_real_tokens(run_shardcheck):
    run = run_shardcheck(
        "run",
        "--impl",
        f"cp_utils={IMPLS / 'padding_cp_utils.py'}",
        "--op",
        "cp_utils.create_context_parallel_ctx",
        "--case",
        "seq-10-not-divisible",
        "--world-sizes",
        "2",
        "--dtype",
        "float64",
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert set(run.rows["check"]) == {"forward", "grad:embed", "grad:pos_embed", "grad:wqkv", "grad:wo", "grad:lm_head"}


def test_a_wrong_padding_fails_on_values_and_gradients(run_shardcheck):
    run = run_shardcheck(
        "run",
        "--impl",
        f"cp_utils={BROKEN / 'cp_utils' / 'pads_on_the_left.py'}",
        "--op",
        "cp_utils.create_context_parallel_ctx",
        "--case",
        "seq-10-not-divisible",
        "--world-sizes",
        "2",
        "--dtype",
        "float64",
    )
    assert run.returncode == 1, run.stdout + run.stderr
    bad = run.failed()
    assert set(bad["check"]) == {"forward", "grad:embed", "grad:pos_embed", "grad:wqkv", "grad:wo", "grad:lm_head"}
    assert (bad["status"] == "fail").all() and "rank 0 (dp=0, cp=0, tp=0)" in bad.iloc[0]["message"]


def test_a_silent_return_without_a_documented_answer_fails(run_shardcheck):
    run = run_shardcheck(
        "run",
        "--impl",
        f"model_utils={BROKEN / 'model_utils' / 'cross_entropy_trims_to_shorter.py'}",
        "--op",
        "model_utils.DistributedCrossEntropy",
        "--case",
        "shape-mismatch",
        "--topology",
        "dp=1,cp=1,tp=2",
        "--dtype",
        "float64",
    )
    # the seed gives no shapes for the two logits: loud-or-right on them is our rule, a warning under --impl (which
    # the strict run fails)
    assert run.returncode == 1, run.stdout + run.stderr
    row = run.rows[run.rows["status"] != "pass"].iloc[0]
    assert row["check"] == "property:bad_input" and row["status"] == "warn"
    assert "(rule: ours, docs/ops/model_utils.md#conventions-of-this-family)" in row["message"]
    assert "returned without an exception on student logits [2, 4, 16] and target logits [2, 3, 16]" in row["message"]
    assert "failing rank(s): 0, 1" in row["message"]


def test_returning_t_unchanged_at_world_size_1_passes_and_a_silent_return_above_fails(run_shardcheck):
    """The seed: dist_gather_tensor "Returns t unchanged when ... world size is 1", whatever t is: a 0-d tensor
    returned there is right (raising too); at world size 2 the op must raise."""
    run = run_shardcheck(
        "run",
        "--impl",
        f"inbatch_neg_utils={IMPLS / 'world1_first_inbatch_neg_utils.py'}",
        "--op",
        "inbatch_neg_utils.dist_gather_tensor",
        "--case",
        "scalar",
        "--case",
        "scalar-world1",
        "--world-sizes",
        "1",
        "--dtype",
        "float64",
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = run.rows
    assert set(rows["case_id"]) == {"scalar-world1"} and (rows["status"] == "pass").all()
    assert "forward" in set(rows["check"])  # the returned t was compared with the input, not waved through
    ours = run_shardcheck(
        "run",
        "--op",
        "inbatch_neg_utils.dist_gather_tensor",
        "--case",
        "scalar",
        "--case",
        "scalar-world1",
        "--world-sizes",
        "1,2",
        "--dtype",
        "float64",
    )
    assert ours.returncode == 0, ours.stdout + ours.stderr
    assert set(ours.rows["case_id"]) == {"scalar", "scalar-world1"}
    silent = run_shardcheck(
        "run",
        "--impl",
        f"inbatch_neg_utils={BROKEN / 'inbatch_neg_utils' / 'scalar_returned_silently.py'}",
        "--op",
        "inbatch_neg_utils.dist_gather_tensor",
        "--case",
        "scalar",
        "--case",
        "scalar-world1",
        "--world-sizes",
        "1,2",
        "--dtype",
        "float64",
    )
    assert silent.returncode == 1, silent.stdout + silent.stderr
    bad = silent.failed()
    assert set(bad["case_id"]) == {"scalar"} and set(bad["dp"]) == {2}
