"""One line per root across symptom kinds, dtypes and rule sources (issue 42, second pass, items 1 to 3): a wrong value
returned in the wrong dtype is a wrong value, so the float64 rows of an op wrong in every dtype are on its one line
(not a "wrong dtype" line beside it) and under a rule of ours stay a FAIL (a silent wrong answer)."""

from __future__ import annotations

import pandas as pd
from helpers import BROKEN, IMPLS, shardcheck

from shardcheck.harness.core.records import SIGNATURE_CHECK, Symptom
from shardcheck.harness.findings.causes import causes
from shardcheck.harness.findings.wording import finding_lines


def test_a_wrong_value_in_the_wrong_dtype_is_one_line_with_the_other_dtypes(tmp_path):
    run = shardcheck(
        "run",
        "--suite",
        "model_utils",
        "--op",
        "model_utils._compute_distributed_log_softmax",
        "--case",
        "b4s4v24-ties",
        "--topology",
        "dp=1,cp=1,tp=2",
        "--dtype",
        "float64,float32",
        "--impl",
        f"model_utils={BROKEN / 'model_utils' / 'float32_log_softmax_no_sum.py'}",
        out=tmp_path,
    )
    assert run.returncode == 1, run.stdout
    failed = run.failed()
    assert set(failed["dtype"]) == {"float64", "float32"}
    assert set(failed["symptom"]) == {Symptom.VALUES}  # the float64 row too, its message naming the dtype
    assert failed[failed["dtype"] == "float64"]["message"].str.contains("dtype float32, expected float64").all()
    assert len(run.causes) == 1, run.causes.to_string()
    line = run.causes.iloc[0]
    assert line["status"] == "fail" and line["kind"] == "wrong values" and line["count"] == 2


def test_dtensor_ids_are_built_on_the_cp_mesh_as_upstreams_callers_build_them(tmp_path):
    """At DP 2 a DTensor of input ids is each DP rank's own batch piece: `full_tensor()` gives that piece (on the
    whole mesh with DP Shard(0) it gave the global batch, and an honest module failed)."""
    run = shardcheck(
        "run",
        "--suite",
        "model_utils",
        "--op",
        "model_utils.get_logprobs_from_vocab_parallel_logits",
        "--case",
        "dtensor_ids-*",
        "--topology",
        "dp=2,cp=1,tp=1",
        "--dtype",
        "float64",
        "--impl",
        f"model_utils={IMPLS / 'full_tensor_ids_model_utils.py'}",
        out=tmp_path,
    )
    assert run.returncode == 0, run.stdout
    assert (run.rows["check"] == "forward").sum() == 2  # the masked case and the seed-rule one


def test_a_crash_on_dtensor_ids_is_an_error_not_a_raise_on_our_rule(tmp_path):
    """DTensor ids run on a seed-rule case (ids in [0, V)) beside the masked one: a module refusing the DTensor
    crashes there too, and its one line stays an error (it was a warn, "raises on input only our rule feeds")."""
    run = shardcheck(
        "run",
        "--suite",
        "model_utils",
        "--op",
        "model_utils.get_logprobs_from_vocab_parallel_logits",
        "--topology",
        "dp=1,cp=1,tp=2",
        "--dtype",
        "float64",
        "--impl",
        f"model_utils={BROKEN / 'model_utils' / 'dtensor_ids_refused.py'}",
        out=tmp_path,
        strict=False,
    )
    assert run.returncode == 1, run.stdout
    assert len(run.causes) == 1, run.causes.to_string()
    line = run.causes.iloc[0]
    assert line["status"] == "error" and line["kind"].startswith("TypeError: input_ids must be a torch.Tensor")
    assert "rule: seed" in line["rule"]


def _row(check: str, status: str, **fields) -> dict:
    return {
        "op": fields.pop("op", "model_utils.F"),
        "case_id": fields.pop("case_id", "c"),
        "dp": 1,
        "cp": fields.pop("cp", 1),
        "tp": fields.pop("tp", 1),
        "dtype": "float64",
        "check": check,
        "status": status,
        "message": fields.pop("message", ""),
        "params": fields.pop("params", {}),
        "culprit_ranks": [0],
        "blocked_ranks": [],
        "phase": "forward",
        **fields,
    }


def test_a_missing_seed_parameter_and_the_typeerror_of_every_call_passing_it_are_one_line():
    missing = "signature: missing parameter(s) w (seed F(x, w), under test F(x))"
    rows = [_row(SIGNATURE_CHECK, "fail", case_id="signature", symptom=Symptom.SIGNATURE, message=missing)]
    raised = dict(
        symptom=Symptom.EXCEPTION,
        error_type="TypeError",
        error_message="F() got an unexpected keyword argument 'w'",
        error_where="shardcheck/harness/rank/signatures.py:252",
    )
    rows += [_row(check, "error", tp=tp, **raised) for tp in (1, 2) for check in ("forward", "grad:x")]
    rows += [_row("forward", "pass", case_id="other")]
    table = causes(pd.DataFrame(rows))
    assert len(table) == 1, finding_lines(table)
    line = table.iloc[0]
    assert line["status"] == "error" and line["count"] == 5
    assert line["kind"].startswith(missing) and "TypeError: F() got an unexpected keyword argument 'w'" in line["kind"]
    assert line["condition"] == "of the module, found before any case ran"
    # a TypeError the module raises itself is its own root
    own = [{**r, "error_where": "their_model_utils.py:9"} if r["status"] == "error" else r for r in rows]
    assert len(causes(pd.DataFrame(own))) == 2


def test_a_rank_dying_of_one_signal_in_one_phase_is_one_line_across_ops_whatever_their_conditions():
    """An op and its wrapper killing gloo with an in-place all_reduce (SIGABRT in the backward): one line, though
    each op's own condition differs (one at cp ≥ 2, the other at cp ≥ 2 for one seq_dim only)."""

    def died(op, cp, seq_dim, phase="backward"):
        return _row(
            "grad:x",
            "error",
            op=op,
            cp=cp,
            case_id=f"d{seq_dim}",
            params={"seq_dim": seq_dim},
            symptom=Symptom.DIED,
            error_type="SIGABRT",
            phase=phase,
        )

    def passed(op, cp, seq_dim):
        return _row("grad:x", "pass", op=op, cp=cp, case_id=f"d{seq_dim}", params={"seq_dim": seq_dim})

    wrapper, op = "model_utils.allgather", "model_utils.AllGather"
    rows = [died(op, 2, d) for d in (0, 1)] + [passed(op, 1, d) for d in (0, 1)]
    rows += [died(wrapper, 2, 0), passed(wrapper, 2, 1), passed(wrapper, 1, 0)]
    table = causes(pd.DataFrame(rows))
    assert len(table) == 1, finding_lines(table)
    assert table.iloc[0]["kind"] == "a rank died (SIGABRT)" and set(table.iloc[0]["ops"]) == {op, wrapper}
    # a death in another phase is another root
    rows += [died("model_utils.Forward", 2, 0, phase="forward"), passed("model_utils.Forward", 1, 0)]
    assert len(causes(pd.DataFrame(rows))) == 2
    # unless a death shares a phase with each (the wrapper dying in the forward too at another topology)
    rows += [{**died(wrapper, 2, 1, phase="forward"), "dp": 2, "cp": 1}]
    assert len(causes(pd.DataFrame(rows))) == 1, finding_lines(causes(pd.DataFrame(rows)))


def test_a_case_with_ids_only_our_rule_feeds_is_judged_under_our_rule_in_every_check():
    """Issue 42, item 2: the rule source is decided by the case's inputs, not by the check: a case with targets
    outside [0, V) (masked) cites our rule for its properties too, not the seed sentence a property has elsewhere."""
    from shardcheck.harness.core.citations import RuleSource
    from shardcheck.suites import model_utils

    cases = model_utils.cases(quick=False)
    masked = [c for c in cases if c.params.get("masked") and c.bad_input is None and c.rules]
    assert masked
    for case in masked:
        for pattern in case.rules:
            assert case.rule_of(pattern.replace("*", "x")).source == RuleSource.OURS, (case.case_id, pattern)
    plain = [c for c in cases if not c.params.get("masked") and "property:chunked_equals_unchunked" in c.rules]
    assert plain and plain[0].rule_of("property:chunked_equals_unchunked").source == RuleSource.SEED


def test_one_unhandled_input_reaching_several_lines_of_a_module_is_one_line():
    """A DTensor target the module never unwraps raises the same error at three lines (three code paths, two ops):
    one root, one line naming both ops; the same message from another file is another root."""
    mixed = dict(symptom=Symptom.EXCEPTION, error_type="RuntimeError", error_message="got mixed Tensor and DTensor")
    rows = [
        _row("forward", "error", op=op, case_id=case, error_where=f"their_model_utils.py:{line}", **mixed)
        for op, case, line in (("model_utils.A", "a1", 127), ("model_utils.A", "a2", 390), ("model_utils.B", "b", 527))
    ]
    rows += [_row("forward", "pass", op=op, case_id="plain") for op in ("model_utils.A", "model_utils.B")]
    table = causes(pd.DataFrame(rows))
    assert len(table) == 1 and table.iloc[0]["ops"] == ("model_utils.A", "model_utils.B"), finding_lines(table)
    rows += [_row("forward", "error", op="model_utils.C", case_id="c", error_where="torch/other.py:9", **mixed)]
    rows += [_row("forward", "pass", op="model_utils.C", case_id="plain")]
    assert len(causes(pd.DataFrame(rows))) == 2
