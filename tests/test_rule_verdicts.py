"""An exception only on input our rule feeds is a `warn` line under --impl, decided per findings line (after the
grouping by root), and the rows, the exit code and the JUnit follow the line (harness/findings/causes.py, module
docstring 5; harness/findings/verdicts.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pandas as pd
from helpers import BROKEN, IMPLS, ROOT

from shardcheck.harness.core.records import Status, Symptom, load
from shardcheck.harness.findings.causes import RAISES_ON_OURS, causes
from shardcheck.harness.findings.verdicts import DEMOTED_NOTE, demote
from shardcheck.harness.findings.wording import finding_lines

OURS = ("ours", "docs/ops/README.md#conventions-shared-by-every-family")
SEED = ("seed", "the op's documented result (its docstring and signature)")
THIRD_PARTY = "their_model_utils.py"


def _raised(
    case: str,
    tp: int,
    check: str,
    rule: tuple[str, str],
    impl: str | None = THIRD_PARTY,
    where: str = "their_model_utils.py:41",
    op: str = "model_utils.DistributedLogprob",
) -> dict:
    return {
        "op": op,
        "case_id": case,
        "dp": 1,
        "cp": 1,
        "tp": tp,
        "dtype": "float64",
        "check": check,
        "status": Status.ERROR,
        "symptom": Symptom.EXCEPTION,
        "error_type": "ValueError",
        "error_message": f"target holds {3 + tp} negative id(s)",
        "error_where": where,
        "phase": "forward",
        "culprit_ranks": [0],
        "blocked_ranks": [],
        "message": "raised",
        "params": {"masked": 0.3},
        "rule_source": rule[0],
        "rule_cite": rule[1],
        "impl": impl,
    }


def _passed(case: str, tp: int, check: str, impl: str | None = THIRD_PARTY) -> dict:
    return {
        "op": "model_utils.DistributedLogprob",
        "case_id": case,
        "dp": 1,
        "cp": 1,
        "tp": tp,
        "dtype": "float64",
        "check": check,
        "status": Status.PASS,
        "symptom": None,
        "message": "",
        "params": {},
        "rule_source": SEED[0],
        "rule_cite": SEED[1],
        "impl": impl,
    }


def _rows(impl: str | None = THIRD_PARTY, seed_case_raises: bool = False) -> pd.DataFrame:
    """A masked case (ours) raising at tp 1 and 2 with its consequences (grad, comm: ours too), a seed case passing
    (or raising the same exception at the same line)."""
    rows = [_raised("masked", tp, check, OURS, impl) for tp in (1, 2) for check in ("forward", "grad:logits")]
    rows += [_raised("masked", tp, "property:comm", OURS, impl) for tp in (1, 2)]
    if seed_case_raises:
        rows += [
            _raised("plain", 2, "forward", SEED, impl),
            _raised("plain", 2, "property:comm", OURS, impl),
            _passed("plain", 1, "forward", impl),
        ]
    else:
        rows += [_passed("plain", tp, "forward", impl) for tp in (1, 2)]
    return pd.DataFrame(rows)


def test_an_exception_only_on_input_our_rule_feeds_is_one_warn_line_under_impl():
    table = causes(_rows())
    assert len(table) == 1, finding_lines(table)
    line = table.iloc[0]
    assert line["status"] == Status.WARN and line["count"] == 6
    assert line["kind"] == RAISES_ON_OURS + "ValueError: target holds N negative id(s) (their_model_utils.py:41)"
    assert line["rule"] == "rule: ours, docs/ops/README.md#conventions-shared-by-every-family"
    assert finding_lines(table)[0].startswith(
        "WARN model_utils.DistributedLogprob: raises on input only our rule feeds: ValueError"
    )


def test_without_a_seed_rule_case_that_ran_clean_there_the_line_stays_an_error():
    """A run of only our-rule cases at a topology (a quick matrix, a --case pattern): nothing says that the input is
    the trigger rather than the op (a rank's own RuntimeError would look the same), so the line stays an error."""
    rows = _rows()
    assert causes(rows[rows["case_id"] == "masked"]).iloc[0]["status"] == Status.ERROR
    no_seed_at_tp2 = rows[~((rows["case_id"] == "plain") & (rows["tp"] == 2))]
    assert causes(no_seed_at_tp2).iloc[0]["status"] == Status.ERROR


def test_a_seed_rule_case_whose_float64_item_warns_of_float32_math_is_evidence_there():
    """The module computes in float32: the seed-rule case's float64 item passes with a precision warning, which cites
    our precision rule.  It ran without the exception all the same (its checks cite the seed's rule in float32), so the
    line is demoted; without that float32 item nothing says the case was the seed's, and the line stays an error."""
    rows = _rows()
    plain = rows["case_id"] == "plain"
    precise = dict(status=Status.WARN, symptom="precision:float32", rule_source=OURS[0], rule_cite=OURS[1])
    warned = rows.assign(**{k: rows[k].where(~plain, v) for k, v in precise.items()})
    f32 = rows[plain].assign(dtype="float32")
    assert causes(pd.concat([warned, f32], ignore_index=True)).iloc[0]["status"] == Status.WARN
    assert causes(warned).iloc[0]["status"] == Status.ERROR


def test_where_a_hang_budget_left_the_seed_rule_case_unrun_the_evidence_elsewhere_decides():
    """At tp 2 the seed-rule case never ran (a hang's budget skipped it): that topology neither clears nor convicts
    the input; the clean seed-rule case at tp 1 is the evidence, and the line is a warn (issue 42)."""
    rows = _rows()
    rows = rows[~((rows["case_id"] == "plain") & (rows["tp"] == 2))]
    skipped = {**_passed("plain", 2, "forward"), "status": Status.SKIP}
    skipped["message"] = (
        "skipped: hung before; its other items at this topology are not run (--no-hang-budget runs them)"
    )
    table = causes(pd.concat([rows, pd.DataFrame([skipped])], ignore_index=True))
    assert len(table) == 1 and table.iloc[0]["status"] == Status.WARN, finding_lines(table)


def test_our_own_implementation_raising_on_our_rule_stays_an_error():
    table = causes(_rows(impl=None))
    assert list(table["status"]) == [Status.ERROR] and not table.iloc[0]["kind"].startswith(RAISES_ON_OURS)


def test_the_same_exception_on_a_seed_rule_case_too_stays_one_error_line():
    table = causes(_rows(seed_case_raises=True))
    assert len(table) == 1, finding_lines(table)
    assert table.iloc[0]["status"] == Status.ERROR and table.iloc[0]["count"] == 8
    assert "rule: ours" in table.iloc[0]["rule"] and "rule: seed" in table.iloc[0]["rule"]
    # across ops too: the seed-rule rows of another op raising at the same line keep the one line an error
    other = _rows()
    other = pd.concat(
        [other, pd.DataFrame([_raised("plain", 2, "forward", SEED, op="model_utils.ChunkedDistributedLogprob")])],
        ignore_index=True,
    )
    table = causes(other)
    assert len(table) == 1 and table.iloc[0]["status"] == Status.ERROR, finding_lines(table)


def test_alike_raises_at_other_lines_of_the_file_on_seed_and_on_our_input_are_two_roots():
    """Issue 42: two ops raise torch's same shape error at lines of their own in one file: the distillation op on a
    CP case the seed describes, the next-token op on plain logits handed a CP group (input only our rule feeds). Two
    roots, two lines: the first an error, the second a warn (they were one error line, the warn inside it)."""
    shape = "Size does not match at dimension 1 expected index [4, 16, 3] to be no larger than self [4, 8, 24]"
    distill = [
        {**_raised("cp-plain", 1, c, SEED, op="model_utils.Distill", where="m.py:1644"), "error_message": shape}
        for c in ("forward", "grad:logits")
    ]
    next_token = [
        {**_raised("cp-plain", 1, c, OURS, op="model_utils.NextToken", where="m.py:1395"), "error_message": shape}
        for c in ("forward", "grad:logits")
    ]
    passed = [
        {**_passed("cp-group", 1, "forward"), "op": op} for op in ("model_utils.Distill", "model_utils.NextToken")
    ]
    for row in distill + next_token + passed:
        row["error_type"] = "RuntimeError" if row.get("error_type") else None
    table = causes(pd.DataFrame(distill + next_token + passed))
    assert len(table) == 2, finding_lines(table)
    status = dict(zip(table["op"], table["status"]))
    assert status == {"model_utils.Distill": Status.ERROR, "model_utils.NextToken": Status.WARN}, finding_lines(table)
    # at one line they share (a helper both call) they stay one root, an error
    for row in next_token:
        row["error_where"] = "m.py:1644"
    table = causes(pd.DataFrame(distill + next_token + passed))
    assert len(table) == 1 and table.iloc[0]["status"] == Status.ERROR, finding_lines(table)


def test_one_raising_line_with_two_messages_is_two_roots_and_each_is_judged_on_its_own():
    """Issue 42, items 2 and 3: one line of the module raises an index error on masked ids (our rule) and a DTensor
    mix-up on DTensor ids (a type the seed documents, here on a seed-rule case): two lines, the first a warn, the
    second an error (one grouped line was demoted whole, the real crash with it)."""
    rows = _rows()
    dtensor = dict(error_type="RuntimeError", error_where="their_model_utils.py:41", op="model_utils.Front")
    mixed = [{**_raised("dtensor_ids", 2, c, SEED), **dtensor} for c in ("forward", "grad:logits")]
    mixed = [{**r, "error_message": "aten.gather.default got mixed torch.Tensor and DTensor"} for r in mixed]
    oob = [{**_raised("masked", 2, c, OURS), **dtensor} for c in ("forward", "grad:logits")]
    oob = [{**r, "error_message": "index 35 is out of bounds for dimension 1 with size 32"} for r in oob]
    passed = [{**_passed("plain", 2, "forward"), "op": "model_utils.Front"}]
    table = causes(pd.concat([rows, pd.DataFrame(mixed + oob + passed)], ignore_index=True))
    kinds = {r.kind: r.status for r in table.itertuples()}
    assert len(table) == 3, finding_lines(table)
    assert kinds["RuntimeError: aten.gather.default got mixed torch.Tensor and DTensor (their_model_utils.py:41)"] == (
        Status.ERROR
    )
    assert kinds[
        RAISES_ON_OURS + "RuntimeError: index N is out of bounds for dimension N with size N (their_model_utils.py:41)"
    ] == (Status.WARN)


def test_the_rows_of_a_demoted_line_become_warn_rows_and_the_line_stays_the_same():
    rows = _rows()
    marked = demote(rows)
    assert set(marked["status"]) == {Status.WARN, Status.PASS}
    demoted = marked[marked["status"] == Status.WARN]
    assert len(demoted) == 6 and set(demoted["demoted_from"]) == {"error"}
    assert all(DEMOTED_NOTE in m and "[rule: ours, docs/ops/README.md#" in m for m in demoted["message"])
    assert causes(marked).equals(causes(rows))  # read back, the rows give the same line
    assert set(demote(_rows(seed_case_raises=True))["status"]) == {Status.ERROR, Status.PASS}  # nothing demoted


# ---- runs: a third-party model_utils refusing −100 targets; one whose same check also refuses valid ids at tp ≥ 2

LOGPROB = (
    "--op",
    "model_utils.DistributedLogprob",
    "--case",
    "b4s8v32",
    "--case",
    "b4s6v37-masked0.3",
    "--topology",
    "dp=1,cp=1,tp=1",
    "--topology",
    "dp=1,cp=1,tp=2",
    "--dtype",
    "float64",
)


def test_a_module_refusing_negative_targets_warns_naming_our_rule_and_exits_0(run_shardcheck, tmp_path):
    impl = f"model_utils={IMPLS / 'rejects_negative_targets_model_utils.py'}"
    junit = tmp_path / "junit.xml"
    run = run_shardcheck("run", "--impl", impl, *LOGPROB, "--junit-xml", str(junit), strict=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith(("  FAIL ", "  ERROR ", "  WARN "))]
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        "  WARN model_utils.DistributedLogprob: raises on input only our rule feeds: "
        "ValueError: target holds N negative id(s)"
    ), lines
    assert "exactly with masked" in lines[0] or "exactly when masked" in lines[0], lines
    assert lines[0].endswith(  # the input's rule, and the communication contract's (the raise is on both rows)
        "[rule: ours, docs/ops/README.md#ids-outside-the-vocab; "
        "rule: ours, docs/ops/README.md#conventions-shared-by-every-family]"
    ), lines
    rows = run.rows
    assert Status.ERROR not in set(rows["status"]) and (rows["demoted_from"] == "error").sum() == 6
    assert set(rows[rows["case_id"] == "b4s8v32"]["status"]) == {Status.PASS}
    assert "0 errors" in run.stdout and "6 warnings" in run.stdout
    suites = ET.parse(junit).getroot()
    assert suites.get("errors") == "0" and suites.get("failures") == "0" and suites.get("tests") == "4"
    assert all("raised only on input our rule feeds" in e.text for e in suites.iter("system-out"))
    report = (run.out / "report.md").read_text()
    assert "6 warn, 0 fail, 0 error" in report and "WARN model_utils.DistributedLogprob: raises on input only" in report
    summary = json.loads((run.out / "run.json").read_text())["summary"]
    assert summary["error"] == 0 and summary["warn"] == 6

    strict = run_shardcheck("run", "--impl", impl, *LOGPROB)  # --strict: the warn fails the run
    assert strict.returncode == 1, strict.stdout[-3000:]
    assert "--strict: 6 warning(s) fail the run" in strict.stdout


def test_the_same_raise_on_valid_ids_too_stays_one_error_line_and_exits_1(run_shardcheck):
    module = BROKEN / "model_utils" / "target_check_local_vocab.py"
    run = run_shardcheck("run", "--impl", f"model_utils={module}", *LOGPROB, strict=False)
    assert run.returncode == 1, run.stdout[-3000:]
    table = run.causes
    assert len(table) == 1, "\n".join(finding_lines(table))
    line = table.iloc[0]
    raise_line = next(i for i, text in enumerate(module.read_text().splitlines(), 1) if "raise ValueError" in text)
    assert line["status"] == Status.ERROR
    assert line["kind"] == f"ValueError: target ids must lie in [N, N) (target_check_local_vocab.py:{raise_line})"
    assert "rule: seed" in line["rule"] and "rule: ours" in line["rule"]
    assert "demoted_from" not in run.rows or run.rows["demoted_from"].isna().all()


def test_settle_rewrites_only_the_demoted_rows_and_the_summary(tmp_path):
    from shardcheck.harness.core.records import RESULTS, RUN_META, load
    from shardcheck.harness.findings.verdicts import settle

    def write(rows: pd.DataFrame, where):
        where.mkdir()
        (where / RESULTS).write_text("".join(json.dumps(r) + "\n" for r in rows.to_dict("records")))
        (where / RUN_META).write_text(json.dumps({"run_id": "r", "summary": {"pass": 2, "warn": 0, "error": 6}}))
        return where

    run = write(_rows(), tmp_path / "demoted")
    settled = settle(run, {Status.PASS: 2, Status.WARN: 0, Status.ERROR: 6})
    counts = settled.counts
    assert counts[Status.ERROR] == 0 and counts[Status.WARN] == 6
    assert json.loads((run / RUN_META).read_text())["summary"]["warn"] == 6
    rows = load(run)
    assert list(rows["status"]).count(Status.WARN) == 6 and set(rows["demoted_from"].dropna()) == {"error"}
    assert len(causes(rows)) == 1 and causes(rows).iloc[0]["status"] == Status.WARN
    # the findings computed once, before the rewrite, are those of the rows it wrote; the rows in memory are them
    assert settled.findings.causes.equals(causes(rows))
    assert list(settled.rows["status"]) == list(rows["status"]) and list(settled.rows["message"]) == list(
        rows["message"]
    )

    kept = write(_rows(seed_case_raises=True), tmp_path / "kept")  # nothing demoted: nothing rewritten
    before = (kept / RESULTS).read_bytes()
    assert settle(kept, {Status.ERROR: 6}).counts == {Status.ERROR: 6} and (kept / RESULTS).read_bytes() == before


def test_a_hand_launched_run_settles_its_demoted_rows_too(tmp_path):
    """harness/standalone.py, under torchrun, decides the same line and exits 0 on it."""
    out = tmp_path / "by-hand"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "1",
            "-m",
            "shardcheck.harness.standalone",
            "--impl",
            f"model_utils={IMPLS / 'rejects_negative_targets_model_utils.py'}",
            *LOGPROB[:6],
            "--topology",
            "dp=1,cp=1,tp=1",
            "--dtype",
            "float64",
            "--out",
            str(out),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = load(out)
    assert Status.ERROR not in set(rows["status"]) and (rows["demoted_from"] == "error").sum() == 3, rows
    assert json.loads((out / "run.json").read_text())["summary"]["error"] == 0
