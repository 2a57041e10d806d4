"""Findings on foreign code: causes (harness.causes), warnings and --strict."""

from __future__ import annotations

import pandas as pd

from helpers import BROKEN, IMPLS, assert_one_cause
from harness.causes import causes, error_template, separating_condition

TP2 = ("--topology", "dp=1,cp=1,tp=2", "--quick")
FP32_IMPL = IMPLS / "fp32_extra_collectives_model_utils.py"


def _row(status, check="forward", tp=2, dtype="float64", op="model_utils.X", masked=0.0, message="", **extra):
    return {"op": op, "case_id": extra.pop("case_id", f"m{masked}"), "status": status, "check": check, "dp": 1,
            "cp": 1, "tp": tp, "dtype": dtype,
            "params": {"B": 2, "masked": masked}, "message": message, "err_ratio": extra.pop("err_ratio", None),
            "mismatch": extra.pop("mismatch", None), "rerun": extra.pop("rerun", None), **extra}


def test_condition_separates_failing_from_passing_rows():
    rows = [_row("fail", "grad:logits", tp, masked=m, err_ratio=50.0, rerun=f"rerun {tp} {m}")
            for tp in (2, 4) for m in (0.2, 0.3)]
    rows += [_row("pass", "grad:logits", tp, masked=0.0) for tp in (1, 2, 4)]
    rows += [_row("pass", "grad:logits", 1, masked=m) for m in (0.2, 0.3)]  # tp 1 passes even when masked
    rows += [_row("pass", "forward", tp, masked=m) for tp in (1, 2, 4) for m in (0.0, 0.3)]
    table = causes(pd.DataFrame(rows))
    assert len(table) == 1
    cause = table.iloc[0]
    assert cause["op"] == "model_utils.X" and cause["kind"] == "wrong values" and cause["count"] == 4
    assert cause["condition"] == "exactly in grad:logits, at tp ≥ 2, when masked ≥ 0.2"
    assert cause["checks"] == "grad:logits" and cause["worst"].startswith("err/budget 50")


def test_errors_group_by_type_template_and_location():
    msg = "rank {r} (dp=0, cp=0, tp={r}): AssertionError: vocab shard of {n} (impl.py:12); failing rank(s): {r}"
    rows = [_row("error", c, message=msg.format(r=r, n=n)) for c in ("forward", "grad:logits") for r, n in ((0, 18), (1, 19))]
    rows += [_row("error", message="rank 0 (dp=0, cp=0, tp=0): RuntimeError: view size is not compatible (impl.py:40)")]
    rows += [_row("pass", tp=1)]
    table = causes(pd.DataFrame(rows))
    assert list(table["kind"]) == ["AssertionError: vocab shard of N (impl.py:12)",
                                   "RuntimeError: view size is not compatible (impl.py:40)"]
    assert list(table["count"]) == [4, 1]
    assert error_template("rank 3 (dp=1, cp=0, tp=1): no result; rank(s) 1 did not finish within 5s") == \
        "no result; rank(s) N did not finish within Ns"


def test_failures_come_before_warnings_and_always_is_said():
    rows = [_row("warn", "property:comm", message="forward all_reduce@tp: 4 call(s) > allowed 3"),
            _row("fail", "forward", dtype="bfloat16", mismatch={"kind": "nonfinite"}),
            _row("pass", "forward", dtype="float64")]
    table = causes(pd.DataFrame(rows))
    assert list(table["status"]) == ["fail", "warn"]
    assert table.iloc[0]["kind"] == "non-finite values differ (NaN/±inf)"
    assert table.iloc[0]["condition"] == "exactly in bfloat16, at dp1-cp1-tp2"
    assert table.iloc[1]["kind"] == "more collectives than the contract allows"
    bad = pd.DataFrame([_row("fail", tp=t) for t in (1, 2)])
    assert separating_condition(bad, bad.iloc[:0]) == "always (every case, dtype and check run), at every topology (dp1-cp1-tp1, dp1-cp1-tp2)"


def test_masked_target_gradient_in_bf16_with_huge_logits_is_caught(run_shardcheck):
    """Caught only thanks to per-row budgets: the leak is ~0.05 of the old tensor-wide budget."""
    run = run_shardcheck("run", "--impl", f"model_utils={BROKEN / 'model_utils' / 'masked_grad_bf16.py'}",
                         "--op", "model_utils.DistributedLogprob", "--dtype", "bfloat16,float64", *TP2)
    assert run.returncode == 1, run.stdout + run.stderr
    cause = assert_one_cause(run)
    assert cause["op"] == "model_utils.DistributedLogprob" and cause["checks"] == "grad:logits"
    assert cause["condition"].startswith("exactly in grad:logits, in bfloat16") and "scale ≥ 300" in cause["condition"]
    row = run.failed().iloc[0]
    assert row["budget"] == 0.0 and row["mismatch"]["expected"] == 0.0 and row["mismatch"]["got"] != 0.0


def test_float32_math_and_extra_collectives_warn_and_pass_unless_strict(run_shardcheck):
    ops = ("--op", "model_utils.DistributedLogprob", "--op", "model_utils.ChunkedDistributedLogprob")
    run = run_shardcheck("run", "--impl", f"model_utils={FP32_IMPL}", *ops, "--dtype", "float64", *TP2, strict=False)
    assert run.returncode == 0, run.stdout + run.stderr
    rows = run.rows
    assert set(rows["status"]) == {"warn"}  # float64 in float32 everywhere, one all-reduce too many everywhere
    table = run.causes
    assert set(table["status"]) == {"warn"} and len(table) == 4
    assert set(table["kind"]) == {"float64 computed in float32", "more collectives than the contract allows"}
    assert set(table["op"]) == {"model_utils.DistributedLogprob", "model_utils.ChunkedDistributedLogprob"}
    assert "Findings (4):" in run.stdout and f"{(rows['status'] == 'warn').sum()} warnings, 0 failed" in run.stdout
    values = rows[rows["check"] != "property:comm"]
    assert (values[values["status"] == "warn"]["message"].str.contains("float64 computed in float32")).all()
    strict = run_shardcheck("run", "--impl", f"model_utils={FP32_IMPL}", "--op", "model_utils.DistributedLogprob",
                            "--case", "b4s6v37-masked0.3", "--dtype", "float64", *TP2)
    assert strict.returncode == 1 and "--strict:" in strict.stdout, strict.stdout + strict.stderr
    assert set(strict.rows["status"]) == {"warn"}


def test_junit_warn_is_a_passing_testcase_with_the_warning_in_system_out():
    import xml.etree.ElementTree as ET

    from reports.junit import junit_tree

    def row(check, status, message=""):
        return {"op": "model_utils.DistributedLogprob", "case_id": "b4", "dp": 1, "cp": 1, "tp": 2, "dtype": "float64",
                "check": check, "status": status, "message": message, "rerun": "shardcheck run --case b4",
                "item_seconds": 0.1}

    df = pd.DataFrame([row("forward", "pass"), row("property:comm", "warn", "forward all_reduce@tp: 4 call(s)")])
    root = ET.fromstring(ET.tostring(junit_tree(df, "run1").getroot()))
    case = root.find("testsuite/testcase")
    assert root.get("failures") == "0" and root.get("errors") == "0" and root.get("skipped") == "0"
    assert case.find("failure") is None and case.find("skipped") is None
    assert case.find("system-out").text == ("warn: property:comm: forward all_reduce@tp: 4 call(s)\n"
                                            "rerun: shardcheck run --case b4")
