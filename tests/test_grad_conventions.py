"""Both CP gradient conventions accepted where the seed does not choose (issue 42, item 4): a DTensor front end's
result is replicated over CP and each CP rank's copy its own summand; ours sums every CP rank's upstream gradient,
the seed's `full_tensor()` keeps each rank's own.  Either passes, without a warning, and the row says which matched;
a gradient matching neither fails, naming both."""

from __future__ import annotations

import pytest
from helpers import BROKEN, IMPLS, shardcheck

from shardcheck import Case, GradConvention
from shardcheck.harness.core.compare import merge_ranks
from shardcheck.harness.core.records import Status

FRONT_END = (
    "--suite",
    "model_utils_cp",
    "--op",
    "model_utils.get_logprobs_from_vocab_parallel_logits",
    "--topology",
    "dp=1,cp=2,tp=1",
    "--dtype",
    "float64,float32",
)


def _grad_rows(run):
    return run.rows[run.rows["check"] == "grad:logits"]


@pytest.mark.parametrize(
    "impl, convention",
    [(None, GradConvention.SUMMED), (IMPLS / "dtensor_own_grad_model_utils.py", GradConvention.OWN)],
)
def test_an_implementation_following_either_convention_passes_and_says_which(tmp_path, impl, convention):
    extra = ("--impl", f"model_utils={impl}") if impl else ()
    run = shardcheck("run", *FRONT_END, *extra, out=tmp_path)  # --strict: not even a warning
    assert run.returncode == 0, run.stdout[-3000:]
    grads = _grad_rows(run)
    assert (
        len(grads) == 6 and (grads["status"] == "pass").all()
    )  # 3 cases (seq_index, Shard(1) masked or not), 2 dtypes
    assert set(grads["grad_convention"]) == {str(convention)}


def test_a_gradient_matching_neither_convention_fails_naming_both(tmp_path):
    impl = BROKEN / "model_utils_cp" / "dtensor_grad_averaged.py"
    run = shardcheck("run", *FRONT_END[:-1], "float64", "--impl", f"model_utils={impl}", out=tmp_path)
    assert run.returncode == 1, run.stdout[-3000:]
    bad = run.failed()
    assert set(bad["check"]) == {"grad:logits"} and (bad["status"] == "fail").all() and len(bad) == 3
    for message in bad["message"]:
        assert "matches no accepted gradient convention" in message
        assert GradConvention.SUMMED.words in message and GradConvention.OWN.words in message
    assert "grad_convention" not in bad or bad["grad_convention"].isna().all()  # none matched
    assert len(run.causes) == 1, run.causes.to_string()


def test_the_sum_alone_stays_the_rule_where_a_case_does_not_declare_both(tmp_path):
    """The CP gather of from_parallel_logits_to_logprobs (no DTensor) keeps the default: each rank's own gradient
    there is a bug (tests/broken/model_utils_cp/gather_backward_no_sum.py is the same backward on AllGatherCPTensor)."""
    impl = BROKEN / "model_utils_cp" / "gather_backward_no_sum.py"
    run = shardcheck(
        "run",
        "--suite",
        "model_utils_cp",
        "--op",
        "model_utils.AllGatherCPTensor",
        "--topology",
        "dp=1,cp=2,tp=1",
        "--dtype",
        "float64",
        "--impl",
        f"model_utils={impl}",
        out=tmp_path,
    )
    assert run.returncode == 1, run.stdout[-3000:]
    bad = run.failed()
    assert set(bad["check"]) == {"grad:x"}
    assert "grad_convention" not in bad or bad["grad_convention"].isna().all()


def test_ranks_passing_under_different_conventions_fail():
    per_rank = [
        {"rank": r, "coords": {"cp": r}, "status": Status.PASS, "grad_convention": c, "message": ""}
        for r, c in ((0, "summed"), (1, "own"))
    ]
    row = merge_ranks(per_rank, [0, 1])
    assert row["status"] == Status.FAIL and "different gradient conventions" in row["message"]
    assert row["grad_convention"] is None
    same = merge_ranks([{**r, "grad_convention": "own"} for r in per_rank], [0, 1])
    assert same["status"] == Status.PASS and same["grad_convention"] == "own"


def test_own_needs_summands():
    with pytest.raises(ValueError, match="needs summands"):
        Case(
            op="f.g",
            case_id="c",
            make_inputs=lambda gen: {},
            reference=lambda x: None,
            run=lambda impl, ctx, x: None,
            grad_conventions=(GradConvention.OWN,),
        )
