"""Findings on foreign code: causes (shardcheck.harness.findings.causes), warnings and --strict."""

from __future__ import annotations

import functools
import json

import pandas as pd
from helpers import BROKEN, IMPLS, assert_one_cause, shardcheck

from shardcheck.harness.core.records import load
from shardcheck.harness.findings.causes import causes
from shardcheck.harness.findings.conditions import separating_condition
from shardcheck.harness.findings.wording import blank_numbers, finding_lines

TP2 = ("--topology", "dp=1,cp=1,tp=2", "--quick")
FP32_IMPL = IMPLS / "fp32_extra_collectives_model_utils.py"


def _row(status, check="forward", tp=2, dtype="float64", op="model_utils.X", masked=0.0, message="", dp=1, **extra):
    """A result row as shardcheck.harness.driver.collect writes it (the cause fields given as keywords)."""
    symptom = extra.pop("symptom", {"fail": "values", "warn": "comm", "error": "exception"}.get(status))
    return {
        "op": op,
        "case_id": extra.pop("case_id", f"m{masked}"),
        "status": status,
        "check": check,
        "dp": dp,
        "cp": 1,
        "tp": tp,
        "dtype": dtype,
        "params": extra.pop("params", {"B": 2, "masked": masked}),
        "message": message,
        "err_ratio": extra.pop("err_ratio", None),
        "mismatch": extra.pop("mismatch", None),
        "rerun": extra.pop("rerun", None),
        "symptom": symptom,
        "culprit_ranks": extra.pop("culprit_ranks", [1]),
        "blocked_ranks": extra.pop("blocked_ranks", []),
        "error_type": extra.pop("error_type", None),
        "error_message": extra.pop("error_message", None),
        "error_where": extra.pop("error_where", None),
        "phase": extra.pop("phase", None),
        **extra,
    }


def test_condition_separates_failing_from_passing_rows():
    rows = [
        _row("fail", "grad:logits", tp, masked=m, err_ratio=50.0, rerun=f"rerun {tp} {m}")
        for tp in (2, 4)
        for m in (0.2, 0.3)
    ]
    rows += [_row("pass", "grad:logits", tp, masked=0.0) for tp in (1, 2, 4)]
    rows += [_row("pass", "grad:logits", 1, masked=m) for m in (0.2, 0.3)]  # tp 1 passes even when masked
    rows += [_row("pass", "forward", tp, masked=m) for tp in (1, 2, 4) for m in (0.0, 0.3)]
    table = causes(pd.DataFrame(rows))
    assert len(table) == 1
    cause = table.iloc[0]
    assert cause["op"] == "model_utils.X" and cause["kind"] == "wrong values" and cause["count"] == 4
    assert cause["condition"] == "exactly in grad:logits, at tp ≥ 2, when masked ≥ 0.2"
    assert cause["checks"] == "grad:logits" and cause["worst"].startswith("err/budget 50")


def test_errors_group_by_type_message_and_location_from_the_fields():
    def error(check, rank, n, type_="AssertionError", text="vocab shard of {n}", where="impl.py:12"):
        return _row(
            "error",
            check,
            message="not read",
            culprit_ranks=[rank],
            error_type=type_,
            error_message=text.format(n=n),
            error_where=f"tests/broken/{where}",
            phase="forward",
        )

    rows = [error(c, r, n) for c in ("forward", "grad:logits") for r, n in ((0, 18), (1, 19))]
    rows += [error("forward", 0, 0, "RuntimeError", "view size is not compatible", "impl.py:40")]
    rows += [_row("pass", tp=1)]
    table = causes(pd.DataFrame(rows))
    assert list(table["kind"]) == [
        "AssertionError: vocab shard of N (impl.py:12)",
        "RuntimeError: view size is not compatible (impl.py:40)",
    ]
    assert list(table["count"]) == [4, 1]
    assert table.iloc[0]["worst"].startswith(
        "rank 0 raised AssertionError in forward at tests/broken/impl.py:12: vocab shard of 18"
    )
    assert blank_numbers("shape [4, 37] vs 36.5 at 1e-3") == "shape [N, N] vs N at N"


def test_failures_come_before_warnings_and_always_is_said():
    rows = [
        _row("warn", "property:comm", message="forward all_reduce@tp: 4 call(s) > allowed 3"),
        _row("fail", "forward", dtype="bfloat16", symptom="nonfinite"),
        _row("pass", "forward", dtype="float64"),
    ]
    table = causes(pd.DataFrame(rows))
    assert list(table["status"]) == ["fail", "warn"]
    assert table.iloc[0]["kind"] == "non-finite values differ (NaN/±inf)"
    assert table.iloc[0]["condition"] == "exactly in bfloat16, at dp1-cp1-tp2"
    assert table.iloc[1]["kind"] == "more collectives than the contract allows"
    bad = pd.DataFrame([_row("fail", tp=t) for t in (1, 2)])
    assert (
        separating_condition(bad, bad.iloc[:0])
        == "always (every case, dtype and check run), at every topology (dp1-cp1-tp1, dp1-cp1-tp2)"
    )


def test_a_condition_most_passing_rows_fall_under_is_no_condition():
    bad = pd.DataFrame([_row("fail", "grad:logits", 2, masked=0.3, case_id=f"c{i}") for i in range(3)])
    passing = pd.DataFrame(
        [_row("pass", "grad:logits", 2, masked=0.3, case_id=f"p{i}") for i in range(8)]
        + [_row("pass", "grad:logits", 2, masked=0.0)]
    )
    condition = separating_condition(bad, passing)
    assert condition.startswith(
        "no condition on checks, dtypes, mesh dims or case parameters separates it from the 9 passing rows"
    ), condition
    sharper = pd.concat(
        [passing, pd.DataFrame([_row("pass", "grad:logits", 2, masked=0.0, case_id=f"q{i}") for i in range(8)])]
    )
    # a condition most passing rows escape still does not separate: it is not printed
    assert separating_condition(bad, sharper).startswith(
        "no condition on checks, dtypes, mesh dims or case parameters separates it from the 17 passing rows"
    )


def _upstream_style_rows() -> list[dict]:
    """An op wrong in every item (the forward), with a gradient wrong exactly at tp ≥ 2, a rank raising
    in the backward of the items with a DP rank without tokens (its DP peer blocks), and the DP-sum property
    failing wherever it is checked (the forward is wrong)."""
    rows = []
    for dp, tp in ((1, 1), (1, 2), (2, 1), (2, 2)):
        for case in ("masked", "dp-rank-empty"):
            params = {"B": 4, "empty": case == "dp-rank-empty"}
            row = functools.partial(_row, dp=dp, tp=tp, case_id=case, params=params)
            rows.append(row("fail", "forward", err_ratio=1e6))
            if case == "dp-rank-empty" and dp > 1:  # rank 0 raised in backward; DP rank 1 (and its TP peer) blocked
                blocked = [1] if tp == 1 else [2, 3]
                for check in ("grad:student_logits", "property:comm"):
                    rows.append(
                        row(
                            "error",
                            check,
                            culprit_ranks=[0],
                            blocked_ranks=blocked,
                            phase="backward",
                            error_type="RuntimeError",
                            error_where="torch/autograd/graph.py:829",
                            error_message="element 0 of tensors does not require grad",
                        )
                    )
                continue
            rows.append(row("fail" if tp > 1 else "pass", "grad:student_logits", err_ratio=1e3))
            rows.append(row("pass", "property:comm"))
            if dp > 1:
                rows.append(row("fail", "property:dp_sum", symptom="property"))
    return rows


def test_an_op_wrong_everywhere_lists_each_symptom_with_its_own_condition():
    table = causes(pd.DataFrame(_upstream_style_rows()))
    assert len(table) == 3, "\n".join(finding_lines(table))
    raised, forward, grad = (table.iloc[i] for i in range(3))
    assert raised["status"] == "error" and raised["kind"].startswith("RuntimeError: element N of tensors")
    assert raised["condition"] == "exactly at dp ≥ 2, with empty" and raised["count"] == 4
    assert raised["worst"].startswith("rank 0 raised RuntimeError in backward at torch/autograd/graph.py:829")
    assert (
        forward["kind"] == "wrong values; property:dp_sum does not hold"
        and forward["checks"] == "forward, property:dp_sum"
    )
    assert forward["condition"].startswith("exactly in forward")
    assert grad["kind"] == "wrong values" and grad["condition"] == "exactly in grad:student_logits, at tp ≥ 2"


def test_a_rank_that_raised_and_its_blocked_peers_are_one_cause_whatever_the_count():
    rows = [r for r in _upstream_style_rows() if r["status"] == "error"]
    rows += [_row("pass", "grad:student_logits", dp=2, tp=tp, params={"B": 4, "empty": False}) for tp in (1, 2)]
    table = causes(pd.DataFrame(rows))
    assert len(table) == 1 and table.iloc[0]["count"] == 4
    assert "then blocked or lost the connection" in table.iloc[0]["worst"]


def test_one_root_across_ops_is_one_line_naming_the_ops():
    def raised(op, tp):
        return _row(
            "error",
            op=op,
            tp=tp,
            error_type="ValueError",
            error_message=f"shard of {17 + tp} rows",
            error_where="tests/broken/model_utils/helper.py:20",
            phase="forward",
            culprit_ranks=[0, 1],
        )

    ops = ["model_utils.A", "model_utils.B", "model_utils.C"]
    rows = [raised(op, tp) for op in ops for tp in (2, 4)] + [_row("pass", op=op, tp=1) for op in ops]
    rows += [_row("warn", "forward", op=op, symptom="precision:float32", tp=tp) for op in ops[:2] for tp in (1, 2)]
    rows += [
        _row("error", "forward", op=op, tp=2, symptom="died", error_type=sig, case_id=f"d{sig}")
        for op, sig in (("model_utils.D", "SIGSEGV"), ("model_utils.D", "SIGABRT"), ("model_utils.E", "SIGBUS"))
    ]
    rows += [_row("pass", op=op, tp=1) for op in ("model_utils.D", "model_utils.E", "model_utils.F")]
    rows += [_row("error", "forward", op="model_utils.F", tp=2, symptom="died", error_type="SIGKILL")]  # killed
    table = causes(pd.DataFrame(rows))
    assert len(table) == 4, "\n".join(finding_lines(table))
    helper = table[table["kind"].str.startswith("ValueError")].iloc[0]
    assert helper["op"] == "model_utils.{A, B, C}" and helper["ops"] == tuple(ops) and helper["count"] == 6
    assert helper["kind"] == "ValueError: shard of N rows (helper.py:20)" and helper["condition"] == "exactly at tp ≥ 2"
    crashed, killed = (table[table["kind"].str.startswith("a rank died")].iloc[i] for i in (0, 1))
    assert crashed["kind"] == "a rank died (SIGABRT, SIGBUS, SIGSEGV)", crashed["kind"]
    assert crashed["ops"] == ("model_utils.D", "model_utils.E") and crashed["condition"] == "exactly at tp ≥ 2"
    assert killed["kind"] == "a rank died (SIGKILL)" and killed["ops"] == ("model_utils.F",)
    warned = table[table["status"] == "warn"].iloc[0]
    assert warned["kind"] == "float64 computed in float32" and warned["op"] == "model_utils.{A, B}"


def test_runs_recorded_before_rows_had_cause_fields_still_load_and_group(tmp_path):
    old = [
        {
            k: v
            for k, v in _row(status, check, tp, message=message).items()
            if k
            not in ("symptom", "culprit_ranks", "blocked_ranks", "error_type", "error_message", "error_where", "phase")
        }
        for status, check, tp, message in (
            ("error", "forward", 2, "rank 1 (dp=0, cp=0, tp=1): RuntimeError: shard check failed (x.py:3)"),
            ("error", "grad:logits", 2, "rank 1 (dp=0, cp=0, tp=1): RuntimeError: shard check failed (x.py:3)"),
            ("fail", "forward", 4, "rank 3 (dp=0, cp=0, tp=3): |err| 2 > budget 1e-10"),
            ("pass", "forward", 1, ""),
        )
    ]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    rows = load(tmp_path)
    assert rows["symptom"].isna().all() and rows["culprit_ranks"].map(len).eq(0).all()
    table = causes(rows)
    assert len(table) == 1 and table.iloc[0]["count"] == 3 and table.iloc[0]["condition"] == "exactly at tp ≥ 2"
    assert table.iloc[0]["kind"] == (
        "error: rank N (dp=N, cp=N, tp=N): RuntimeError: shard check failed (x.py:N); wrong values"
    )


KD_EMPTY_DP_RANK = ("--case", "*dp-rank-empty")  # DP rank 0 of 2 holds no valid token


def test_a_rank_raising_in_backward_and_its_blocked_peers_are_one_cause(run_shardcheck):
    """The rank without tokens raises in backward; its DP peer (one rank at tp 1, two at tp 2) blocks in the
    next collective: one cause, named by the exception, whatever the count of blocked ranks."""
    run = run_shardcheck(
        "run",
        "--impl",
        f"kd_loss={BROKEN / 'kd_loss' / 'no_graph_without_tokens.py'}",
        "--op",
        "kd_loss.KDLoss",
        *KD_EMPTY_DP_RANK,
        "--topology",
        "dp=2,cp=1,tp=1",
        "--topology",
        "dp=2,cp=1,tp=2",
        "--dtype",
        "float64",
        "--quick",
        "--timeout",
        "20",
        timeout=400,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    cause = assert_one_cause(run)
    # the blocked ranks were waited for RAISED_GRACE (10 s) after the raise, not --timeout: the message says which
    assert run.rows["message"].str.contains("did not finish the case within 10s of the raise").any()
    assert cause["status"] == "error" and cause["kind"].startswith(
        "RuntimeError: element N of tensors does not require grad and does not have a grad_fn"
    ), cause["kind"]
    assert "raised RuntimeError in backward" in cause["worst"] and "then blocked" in cause["worst"]
    errors = run.rows[run.rows["status"] == "error"]
    assert set(errors["tp"]) == {1, 2}
    for _, row in errors.iterrows():  # the DP rank 0 ranks raised; the DP rank 1 ranks blocked
        assert row["symptom"] == "exception" and row["phase"] == "backward" and row["error_type"] == "RuntimeError"
        assert row["culprit_ranks"] == list(range(row["tp"])), row["culprit_ranks"]
        assert row["blocked_ranks"] == list(range(row["tp"], 2 * row["tp"])), row["blocked_ranks"]


def test_three_bugs_under_three_conditions_are_three_lines(tmp_path):
    """A loss wrong everywhere (cross-entropy for KL), with a student gradient wrong at tp >= 2 and a raise in
    backward where a DP rank holds no token: each bug is a line of its own, with its own condition."""
    run = shardcheck(
        "run",
        "--impl",
        f"kd_loss={BROKEN / 'kd_loss' / 'upstream_style_three_bugs.py'}",
        "--op",
        "kd_loss.KDLoss",
        "--case",
        "dtensor-b4s6v37-T2-nbltensor-chunk0-masked",
        *KD_EMPTY_DP_RANK,
        "--topology",
        "dp=1,cp=1,tp=1",
        "--topology",
        "dp=1,cp=1,tp=2",
        "--topology",
        "dp=2,cp=1,tp=1",
        "--dtype",
        "float64",
        "--quick",
        "--timeout",
        "5",  # the blocked DP rank's peers wait min(RAISED_GRACE, --timeout) after the raise: 5 s, not 10
        out=tmp_path / "run",
        timeout=400,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    table = run.causes
    lines = "\n".join(finding_lines(table))
    assert len(table) == 3 and set(table["op"]) == {"kd_loss.KDLoss"}, lines
    raised, forward, grad = (
        table[table["checks"].str.contains(c)].iloc[0] for c in ("property:comm", "^forward", "^grad:student_logits$")
    )
    assert raised["status"] == "error" and raised["kind"].startswith("RuntimeError: element N of tensors"), lines
    assert raised["condition"].startswith("exactly at dp ≥ 2"), lines
    assert forward["kind"].startswith("wrong values") and forward["condition"].startswith("exactly in forward"), lines
    assert grad["kind"] == "wrong values, a mesh size times the right ones", lines  # ×TP: a root of its own
    assert grad["condition"] == "exactly in grad:student_logits, at tp ≥ 2", lines
    for cause in table.itertuples():
        assert f"{cause.status.upper()} {cause.op}: {cause.kind} — {cause.condition}" in run.stdout


def test_three_bugs_are_three_lines_in_a_full_run_of_every_dtype(tmp_path):
    """The same module across float64, float32 and bfloat16: a symptom present in every dtype is not lost in the
    dtype split, and the hang's consequences stay on its line (the forward, wrong before the backward raised,
    stays on the forward's)."""
    run = shardcheck(
        "run",
        "--impl",
        f"kd_loss={BROKEN / 'kd_loss' / 'upstream_style_three_bugs.py'}",
        "--op",
        "kd_loss.KDLoss",
        "--case",
        "dtensor-b4s6v37-T2-nbltensor-chunk0-masked",
        *KD_EMPTY_DP_RANK,
        "--topology",
        "dp=1,cp=1,tp=1",
        "--topology",
        "dp=1,cp=1,tp=2",
        "--topology",
        "dp=2,cp=1,tp=1",
        "--quick",
        "--timeout",
        "5",  # the blocked DP rank's peers wait min(RAISED_GRACE, --timeout) after the raise: 5 s, not 10
        out=tmp_path / "run",
        timeout=400,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert set(run.rows["dtype"]) == {"float64", "float32", "bfloat16"}
    table = run.causes
    lines = "\n".join(finding_lines(table))
    assert len(table) == 3, lines
    raised = table[table["status"] == "error"].iloc[0]
    assert raised["kind"].startswith("RuntimeError: element N of tensors") and "at dp ≥ 2" in raised["condition"], lines
    forward = table[table["checks"].str.startswith("forward")].iloc[0]
    assert forward["kind"].startswith("wrong values") and forward["condition"].startswith("exactly in forward"), lines
    grad = table[table["checks"] == "grad:student_logits"]
    assert len(grad) == 1 and grad.iloc[0]["condition"] == "exactly in grad:student_logits, at tp ≥ 2", lines


def test_a_helper_several_ops_share_raising_for_all_of_them_is_one_line(run_shardcheck):
    ops = [
        f"model_utils.{name}"
        for name in ("DistributedLogprob", "ChunkedDistributedLogprob", "_compute_distributed_log_softmax")
    ]
    run = run_shardcheck(
        "run",
        "--impl",
        f"model_utils={BROKEN / 'model_utils' / 'shared_helper_raises.py'}",
        *(arg for op in ops for arg in ("--op", op)),
        "--topology",
        "dp=1,cp=1,tp=1",
        "--topology",
        "dp=1,cp=1,tp=2",
        "--dtype",
        "float64",
        "--quick",
    )
    assert run.returncode == 1, run.stdout + run.stderr
    cause = assert_one_cause(run)
    assert len(run.causes) == 1 and set(cause["ops"]) == set(ops)
    raise_line = next(
        i
        for i, line in enumerate((BROKEN / "model_utils" / "shared_helper_raises.py").read_text().splitlines(), 1)
        if "raise ValueError" in line
    )
    assert cause["kind"] == (
        f"ValueError: log-softmax over N vocab shards of N is not supported (shared_helper_raises.py:{raise_line})"
    )
    assert cause["condition"] == "exactly at tp ≥ 2"
    assert cause["op"].startswith("model_utils.{") and all(op.split(".")[1] in cause["op"] for op in ops)
    # each failing item prints the raise once, on the checks it failed together, not once per check
    item = run.stdout.split("ERROR model_utils.DistributedLogprob [", 1)[1].split("\nrerun: ", 1)[0]
    assert item.count("ValueError") == 1 and "  forward, grad:logits, property:comm: rank 0" in item, item


def test_masked_target_gradient_in_bf16_with_huge_logits_is_caught(run_shardcheck):
    """Caught only thanks to per-row budgets: the leak is ~0.05 of the old tensor-wide budget."""
    run = run_shardcheck(
        "run",
        "--impl",
        f"model_utils={BROKEN / 'model_utils' / 'masked_grad_bf16.py'}",
        "--op",
        "model_utils.DistributedLogprob",
        "--dtype",
        "bfloat16,float64",
        *TP2,
    )
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
    # two findings over the module, each one line naming both ops
    assert set(table["status"]) == {"warn"} and len(table) == 2
    assert set(table["kind"]) == {"float64 computed in float32", "more collectives than the contract allows"}
    assert all(
        set(ops) == {"model_utils.DistributedLogprob", "model_utils.ChunkedDistributedLogprob"} for ops in table["ops"]
    )
    assert "Findings (2):" in run.stdout and f"{(rows['status'] == 'warn').sum()} warnings, 0 failed" in run.stdout
    values = rows[rows["check"] != "property:comm"]
    assert (values[values["status"] == "warn"]["message"].str.contains("float64 computed in float32")).all()
    strict = run_shardcheck(
        "run",
        "--impl",
        f"model_utils={FP32_IMPL}",
        "--op",
        "model_utils.DistributedLogprob",
        "--case",
        "b4s6v37-masked0.3",
        "--dtype",
        "float64",
        *TP2,
    )
    assert strict.returncode == 1 and "--strict:" in strict.stdout, strict.stdout + strict.stderr
    assert set(strict.rows["status"]) == {"warn"}


def test_junit_warn_is_a_passing_testcase_with_the_warning_in_system_out():
    import xml.etree.ElementTree as ET

    from shardcheck.reports.junit import junit_tree

    def row(check, status, message=""):
        return {
            "op": "model_utils.DistributedLogprob",
            "case_id": "b4",
            "dp": 1,
            "cp": 1,
            "tp": 2,
            "dtype": "float64",
            "check": check,
            "status": status,
            "message": message,
            "rerun": "shardcheck run --case b4",
            "item_seconds": 0.1,
        }

    df = pd.DataFrame([row("forward", "pass"), row("property:comm", "warn", "forward all_reduce@tp: 4 call(s)")])
    root = ET.fromstring(ET.tostring(junit_tree(df, "run1").getroot()))
    case = root.find("testsuite/testcase")
    assert root.get("failures") == "0" and root.get("errors") == "0" and root.get("skipped") == "0"
    assert case.find("failure") is None and case.find("skipped") is None
    assert case.find("system-out").text == (
        "warn: property:comm: forward all_reduce@tp: 4 call(s)\nrerun: shardcheck run --case b4"
    )


def _thd_rows(pre_fix: bool) -> list[dict]:
    """A THD batch op in two versions: both raise KeyError('position_ids') when the case passes no positions (a defect
    the fix kept); the pre-fix one also computes its padding mask from token ids, so `property:padding_mask` fails
    wherever a sequence is padded, raised or not."""
    rows = []
    for cp in (1, 2):
        for positions in ("none", "given"):
            for padded in (False, True):
                params = {"positions": positions, "padded": padded}
                case = f"{positions}-{'padded' if padded else 'full'}"
                row = functools.partial(_row, cp=cp, tp=1, case_id=case, params=params)
                if positions == "none" and cp > 1:
                    rows.append(
                        row(
                            "error",
                            "forward",
                            phase="forward",
                            error_type="KeyError",
                            error_where="thd.py:41",
                            error_message="'position_ids'",
                            culprit_ranks=[0, 1],
                        )
                    )
                else:
                    rows.append(row("pass", "forward"))
                mask_wrong = pre_fix and padded
                rows.append(
                    row(
                        "fail" if mask_wrong else "pass",
                        "property:padding_mask",
                        symptom="property" if mask_wrong else None,
                    )
                )
    return rows


def test_a_defect_the_fixed_version_lacks_is_a_line_the_fixed_version_does_not_print():
    """One root per line: the property failing in items that did not raise is its own line, not one more check on
    the exception's line; in the items that raised it is the exception's consequence."""
    fixed, pre_fix = causes(pd.DataFrame(_thd_rows(False))), causes(pd.DataFrame(_thd_rows(True)))
    assert len(fixed) == 1 and len(pre_fix) == 2, "\n".join(finding_lines(pre_fix))
    shared = fixed.iloc[0]
    assert shared["kind"] == "KeyError: 'position_ids' (thd.py:41)"
    assert (
        shared["condition"].startswith("exactly")
        and "at cp ≥ 2" in shared["condition"]
        and "with positions = none" in shared["condition"]
    ), shared["condition"]
    same = pre_fix[pre_fix["kind"] == shared["kind"]].iloc[0]
    assert same["condition"] == shared["condition"]  # the line the fixed version prints, unchanged
    assert same["checks"] == "forward, property:padding_mask"  # where else it shows: its consequence, counted
    new = pre_fix[pre_fix["kind"] != shared["kind"]].iloc[0]
    assert new["kind"] == "property:padding_mask does not hold" and new["status"] == "fail"
    assert new["condition"].startswith("exactly") and "with padded" in new["condition"], new["condition"]
    assert new["count"] == 3  # padded items that did not raise: cp = 1 (both positions) and cp = 2 with positions
    assert not set(fixed["kind"]) & {new["kind"]}


def test_a_condition_says_which_items_of_its_topology_a_hang_left_unrun():
    rows = [
        _row("pass", "forward", tp=1, case_id="a", params={"scale": 1}),
        _row("error", "forward", tp=2, case_id="b", params={"scale": 30}, symptom="hung", phase="forward"),
        _row("pass", "forward", tp=2, case_id="a", params={"scale": 1}),
        _row(
            "skip",
            "forward",
            tp=2,
            case_id="c",
            params={"scale": 3},
            symptom=None,
            message="skipped: model_utils.X hung in case b float64 at dp1-cp1-tp2; its other items at this "
            "topology are not run (--no-hang-budget runs them)",
        ),
        _row(
            "skip",
            "forward",
            tp=2,
            case_id="d",
            params={"scale": 4},
            symptom=None,
            message="the case's shapes cannot be laid out here",
        ),
    ]  # a plan's skip: not the hang's
    line = causes(pd.DataFrame(rows)).iloc[0]
    assert line["condition"].endswith(
        "(from the items that ran: 1 item(s) at dp1-cp1-tp2 float64 were skipped after a hang and may show it too)"
    ), line["condition"]


def test_a_line_names_the_first_checks_of_a_long_list_and_counts_the_rest():
    checks = ["forward"] + [f"grad:layers.{i}.weight" for i in range(40)]
    table = pd.DataFrame(
        [
            {
                "op": "m.f",
                "status": "error",
                "kind": "ValueError: no (m.py:3)",
                "condition": "always",
                "checks": ", ".join(checks),
                "count": 41,
                "worst": "rank 0 raised",
                "rerun": None,
                "rule": "",
            }
        ]
    )
    line = finding_lines(table)[0]
    assert "forward, grad:layers.0.weight, grad:layers.1.weight" in line and "grad:layers.5.weight" not in line
    assert line.endswith("grad:layers.4.weight and 35 more checks; 41 row(s)"), line
    table.loc[0, "checks"] = ", ".join(checks[:7])  # seven: all of them, never "and 1 more"
    assert "grad:layers.5.weight; 41 row(s)" in finding_lines(table)[0]
