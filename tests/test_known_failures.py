"""Known failures (shardcheck.KnownFailure): `xfail` while a marked check fails, `xpass` once it passes, from the
plan through the driver's merge to the exit code, the CLI summary, the findings, the reports, JUnit and compare.

Most tests merge seeded per-rank events with the driver's own Collector (no launch); two end-to-end runs (one
launch of two ranks each) put an external suite whose op has a marked defect under test
(tests/fixtures/known_failures)."""

from __future__ import annotations

import dataclasses
import json
import xml.etree.ElementTree as ET

import pandas as pd
import pytest
from helpers import FIXTURES, Run, cli, shardcheck

from shardcheck.harness.core.events import Events, events_path
from shardcheck.harness.core.known_failure import KnownFailure
from shardcheck.harness.core.options import RunSettings, UsageError
from shardcheck.harness.core.plan_data import Item, Plan, Xfail
from shardcheck.harness.core.records import load
from shardcheck.harness.core.topology import Topology
from shardcheck.harness.driver import planner as plan_module
from shardcheck.harness.driver.collect import Collector
from shardcheck.harness.driver.planner import Selection, build_plan
from shardcheck.harness.driver.run import EXIT_FAIL, EXIT_OK, close_run, exit_code, open_run
from shardcheck.harness.findings.causes import causes
from shardcheck.harness.findings.known import known_failures, known_failures_line
from shardcheck.harness.findings.wording import finding_lines
from shardcheck.reports import junit
from shardcheck.reports.dashboard import load_runs, status_counts
from shardcheck.reports.regression import compare_runs
from shardcheck.reports.report import build

OP = "model_utils.DistributedLogprob"
MARK = Xfail(
    reason="vocab offset off by one on ranks past the first shard",
    reference="https://example.org/issues/7",
    checks=["*"],
)


# ---- seeded rows: per-rank events merged by the driver's Collector ----------------------------------------------


def _item(item_id, case_id, checks, dtype="float64", xfail=None, tp=2) -> Item:
    return Item(
        id=item_id,
        suite="model_utils",
        op=OP,
        case_id=case_id,
        dtype=dtype,
        topology=(1, 1, tp),
        world_size=tp,
        seed=item_id,
        checks=checks,
        params={"B": 4, "masked": 0.3},
        xfail=xfail,
    )


def _check_event(status: str, rank: int) -> dict:
    """One rank's result as the worker reports it: a wrong value on rank 1 is 1.98 where -0.097 was expected."""
    if status == "fail":
        return {
            "status": "fail",
            "message": "",
            "max_abs_err": 2.07,
            "err_ratio": 1.0e10,
            "budget": 2.07e-10,
            "worst": {"local_index": [1, 2, 8], "global_index": [1, 2, 27], "expected": -0.0973, "got": 1.98},
            "symptom": "values",
        }
    if status == "warn":
        return {"status": "warn", "message": "forward all_reduce@tp: 4 call(s) > allowed 3", "symptom": "comm"}
    if status == "precision":  # a wrong value whose error fits the bfloat16-math budget
        return {
            "status": "warn",
            "message": "|err| 0.02 fits the bfloat16-math budget",
            "max_abs_err": 0.02,
            "err_ratio": 40.0,
            "budget": 5e-4,
            "symptom": "precision:bfloat16",
        }
    if status == "skip":
        return {"status": "skip", "message": "needs the [megatron] extra"}
    return {"status": "pass", "message": "", "max_abs_err": 1e-17, "err_ratio": 0.01 + 0.001 * rank, "budget": 1e-15}


def _emit(events: dict[int, Events], item: Item, results: dict[str, dict[int, str]] | None) -> None:
    """Rank events of `item`: every check's status per rank, or (results None) a hang: rank 1 never leaves forward."""
    ranks = range(item.world_size)
    for r in ranks:
        events[r].started(item.id)
        events[r].phase(item.id, "forward")
    if results is None:
        events[0].stuck(item.id, [1], 10.0)
        return
    for check, per_rank in results.items():
        for r in ranks:
            events[r].checked(
                item.id, check=check, coords={"dp": 0, "cp": 0, "tp": r}, **_check_event(per_rank.get(r, "pass"), r)
            )
    for r in ranks:
        events[r].done(item.id, 0.1)


@pytest.fixture
def seeded_run(tmp_path):
    """A run of one op: a marked item still failing (grad:logits on rank 1), the same case unmarked in float32
    (the mark's `when` left it out) failing, a marked item now passing, a marked item that hangs, and a marked item
    with a skipped and a warning check.  Written as the driver writes runs: open_run, Collector, close_run."""
    checks = ["forward", "grad:logits", "property:comm"]
    items = [
        _item(0, "b4s6v37-masked0.3", checks, xfail=MARK),
        _item(1, "b4s6v37-masked0.3", checks, dtype="float32"),
        _item(2, "b4s6v37", checks, xfail=MARK),
        _item(3, "b4s8v64", checks, xfail=MARK),
        _item(4, "b2s4v16", checks, xfail=MARK),
    ]
    plan = Plan(
        run_id="seeded",
        quick=True,
        settings=RunSettings(device="cpu", backend="gloo", timeout=10.0, seed=0),
        impl={"model_utils": "shardcheck.distributed_impl.model_utils"},
        items=items,
    )
    run_dir = tmp_path / "run"
    events_dir = run_dir / "workers" / "w2-launch0"
    events = {r: Events(events_path(events_dir, r), r) for r in range(2)}
    _emit(events, items[0], {"grad:logits": {1: "fail"}, "forward": {}, "property:comm": {}})
    _emit(events, items[1], {"forward": {}, "grad:logits": {1: "fail"}, "property:comm": {}})
    _emit(events, items[2], {"forward": {}, "grad:logits": {}, "property:comm": {}})
    _emit(events, items[3], None)
    _emit(
        events,
        items[4],
        {"forward": {0: "skip", 1: "skip"}, "grad:logits": {}, "property:comm": {0: "warn", 1: "warn"}},
    )
    writer, meta = open_run(run_dir, plan, ["shardcheck", "run"])
    collector = Collector(plan, items, events_dir, writer, 2)
    collector.poll()
    assert [i.id for i in collector.unfinished()] == [3]
    collector.abort(items[3], "")  # the launch's hang path
    close_run(run_dir, writer, meta)
    return run_dir, writer.counts


def _status(rows: pd.DataFrame, case_id: str, dtype: str = "float64") -> dict[str, str]:
    of = rows[(rows["case_id"] == case_id) & (rows["dtype"] == dtype)]
    return dict(zip(of["check"], of["status"]))


def test_the_merge_turns_marked_failures_into_xfail_and_marked_passes_into_xpass(seeded_run):
    run_dir, counts = seeded_run
    rows = load(run_dir)
    # still failing: the failing check is xfail, the finding kept; its passing checks stay pass (the mark is needed)
    assert _status(rows, "b4s6v37-masked0.3") == {"forward": "pass", "grad:logits": "xfail", "property:comm": "pass"}
    known = rows[rows["status"] == "xfail"].set_index(["case_id", "check"]).loc[("b4s6v37-masked0.3", "grad:logits")]
    assert known["message"].startswith("rank 1 (dp=0, cp=0, tp=1): |err| 2.08 > budget 2.07e-10 at global (1, 2, 27)")
    assert known["message"].endswith(
        "; known failure: vocab offset off by one on ranks past the first shard (https://example.org/issues/7)"
    )
    assert known["symptom"] == "values" and known["culprit_ranks"] == [1]  # what the known failure looks like
    assert known["xfail_reason"] == MARK.reason and known["xfail_reference"] == MARK.reference
    assert known["rerun"].startswith("shardcheck run --suite model_utils --op model_utils.DistributedLogprob")
    # the mark's `when` left float32 out: a failure like any other
    assert _status(rows, "b4s6v37-masked0.3", "float32")["grad:logits"] == "fail"
    # every marked check passes on every rank: xpass, saying the mark must go
    assert set(_status(rows, "b4s6v37").values()) == {"xpass"}
    xpass = rows[rows["status"] == "xpass"].iloc[0]
    assert "passes on every rank" in xpass["message"] and "remove the KnownFailure mark" in xpass["message"]
    assert xpass["symptom"] == "xpass" and isinstance(xpass["rerun"], str)
    # a hang of a marked item is a known failure too, its cause kept
    hung = rows[rows["case_id"] == "b4s8v64"]
    assert set(hung["status"]) == {"xfail"} and set(hung["symptom"]) == {"hung"}
    assert hung["message"].str.contains("did not finish the case within 10s").all()
    # skips stay skips, warnings warnings; with nothing marked failing, the passing grad:logits is xpass
    assert _status(rows, "b2s4v16") == {"forward": "skip", "grad:logits": "xpass", "property:comm": "warn"}
    # counted by the writer and in run.json
    assert counts == {"pass": 4, "warn": 1, "fail": 1, "error": 0, "skip": 1, "xfail": 4, "xpass": 4}
    assert json.loads((run_dir / "run.json").read_text())["summary"] == counts


def test_a_marked_error_within_the_bfloat16_budget_is_xfail(tmp_path):
    """A marked check whose error fits the bfloat16-math budget (a precision `warn` on every rank) is the known
    failure all the same: `xfail`, not `warn`, and its passing sibling stays `pass` (the mark still needed)."""
    item = _item(0, "b4s6v37", ["forward", "grad:logits"], dtype="bfloat16", xfail=MARK)
    plan = Plan(
        run_id="bf16",
        quick=True,
        settings=RunSettings(device="cpu", backend="gloo", timeout=10.0, seed=0),
        impl={"model_utils": "shardcheck.distributed_impl.model_utils"},
        items=[item],
    )
    run_dir = tmp_path / "run"
    events_dir = run_dir / "workers" / "w2-launch0"
    events = {r: Events(events_path(events_dir, r), r) for r in range(2)}
    _emit(events, item, {"forward": {}, "grad:logits": {0: "precision", 1: "precision"}})
    writer, meta = open_run(run_dir, plan, ["shardcheck", "run"])
    Collector(plan, [item], events_dir, writer, 2).poll()
    close_run(run_dir, writer, meta)
    rows = load(run_dir)
    assert _status(rows, "b4s6v37", "bfloat16") == {"forward": "pass", "grad:logits": "xfail"}
    row = rows[rows["check"] == "grad:logits"].iloc[0]
    assert row["symptom"] == "precision:bfloat16" and row["message"].endswith("(https://example.org/issues/7)")
    assert writer.counts["warn"] == 0 and writer.counts["xfail"] == 1


def test_xfail_never_fails_a_run_and_xpass_always_does():
    none = {"pass": 5, "warn": 0, "fail": 0, "error": 0, "skip": 1, "xfail": 0, "xpass": 0}
    assert exit_code({**none, "xfail": 7}, strict=True) == EXIT_OK
    assert exit_code({**none, "xfail": 7, "xpass": 1}, strict=False) == EXIT_FAIL
    assert exit_code({**none, "xfail": 7, "warn": 1}, strict=False) == EXIT_OK
    assert exit_code({**none, "xfail": 7, "warn": 1}, strict=True) == EXIT_FAIL


def test_xfail_rows_are_no_cause_and_an_xpass_is_a_finding_of_its_own(seeded_run):
    run_dir, _ = seeded_run
    rows = load(run_dir)
    table = causes(rows)
    assert list(table["status"]) == ["fail", "xpass", "warn"], "\n".join(finding_lines(table))
    failed, xpass, _ = (table.iloc[i] for i in range(3))
    assert failed["kind"] == "wrong values" and failed["count"] == 1  # the unmarked float32 row alone
    assert xpass["kind"] == "a known failure now passes: remove its KnownFailure mark" and xpass["count"] == 4
    assert xpass["condition"] == "in 2 item(s) at dp1-cp1-tp2 in float64"  # where the mark no longer holds
    lines = finding_lines(table)
    at = lines.index(
        next(
            line
            for line in lines
            if line.startswith("XPASS model_utils.DistributedLogprob: a known failure now passes")
        )
    )
    assert lines[at + 1].startswith("    worst: passes on every rank, but is marked as a known failure")
    assert lines[at + 2].startswith("    rerun: shardcheck run ")
    known = known_failures(rows)
    assert len(known) == 1
    entry = known.iloc[0]
    assert (entry["reason"], entry["reference"], entry["count"], entry["items"]) == (MARK.reason, MARK.reference, 4, 2)
    assert entry["checks"] == "forward, grad:logits, property:comm" and entry["where"] == "at dp1-cp1-tp2 in float64"
    assert known_failures_line(known) == (
        f"Known failures (4 xfail row(s), not failing the run): {OP}: {MARK.reason} ({MARK.reference}), 4 row(s)"
    )


def test_junit_skips_a_known_failure_with_its_reason_and_fails_an_xpass(seeded_run):
    run_dir, _ = seeded_run
    root = ET.fromstring(ET.tostring(junit.junit_tree(load(run_dir), "seeded").getroot()))
    assert {k: root.get(k) for k in ("tests", "failures", "errors", "skipped")} == {
        "tests": "5",
        "failures": "3",
        "errors": "0",
        "skipped": "2",
    }
    cases = {c.get("name"): c for c in root.iter("testcase")}
    for name in ("b4s6v37-masked0.3 [dp1-cp1-tp2 float64]", "b4s8v64 [dp1-cp1-tp2 float64]"):
        skipped = cases[name].find("skipped")
        assert skipped.get("type") == "shardcheck.xfail" and cases[name].find("failure") is None
        assert skipped.get("message") == f"known failure: {MARK.reason} ({MARK.reference})"
        assert "rerun: shardcheck run" in skipped.text
    xpass = cases["b4s6v37 [dp1-cp1-tp2 float64]"].find("failure")
    assert xpass.get("type") == "shardcheck.xpass"
    assert xpass.get("message") == (
        f"forward: known failure: {MARK.reason} ({MARK.reference}) now passes on every rank; remove its mark"
    )
    assert "rerun: shardcheck run" in xpass.text
    # an xpass beside a warning and a skip is still a failure
    assert cases["b2s4v16 [dp1-cp1-tp2 float64]"].find("failure").get("type") == "shardcheck.xpass"
    assert cases["b4s6v37-masked0.3 [dp1-cp1-tp2 float32]"].find("failure").get("type") == "shardcheck.values"


def test_the_report_counts_colours_and_lists_known_failures_with_reason_reference_and_rerun(seeded_run):
    run_dir, _ = seeded_run
    build(run_dir)
    md = (run_dir / "report.md").read_text()
    assert "**15 checks: 4 pass, 1 warn, 1 fail, 0 error, 1 skip, 4 xfail, 4 xpass**" in md
    section = md.split("## Known failures (4 xfail rows, not failing the run)")[1].split("\n## ")[0]
    assert f"**{OP}: {MARK.reason} ({MARK.reference})**" in section
    assert "forward, grad:logits, property:comm; 4 row(s) in 2 item(s) at dp1-cp1-tp2 in float64" in section
    assert "rerun: shardcheck run --suite model_utils --op model_utils.DistributedLogprob" in section
    # the xpass items are failing items, with their rerun line; the known failures are not
    failing = md.split("## Failing items")[1]
    assert "### XPASS model_utils.DistributedLogprob [b4s6v37] dp1-cp1-tp2 float64" in failing
    assert "### FAIL model_utils.DistributedLogprob [b4s6v37-masked0.3] dp1-cp1-tp2 float32" in failing
    assert "[b4s8v64]" not in failing
    page = (run_dir / "report.html").read_text()
    assert "<h2>Known failures (4 xfail rows, not failing the run)</h2>" in page
    assert f"<a href='{MARK.reference}'>{MARK.reference}</a>" in page
    assert '<td class="xpass">xpass</td>' in page and "td.xfail{" in page


def test_compare_says_how_known_failures_changed_and_gates_a_check_that_stopped_passing(tmp_path):
    def run(name, statuses):
        d = tmp_path / name
        d.mkdir()
        rows = [
            {
                "run_id": name,
                "op": OP,
                "case_id": case,
                "dp": 1,
                "cp": 1,
                "tp": 2,
                "dtype": "float64",
                "device": "cpu",
                "check": "forward",
                "status": status,
            }
            for case, status in statuses.items()
        ]
        (d / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return d

    base = run(
        "base",
        {
            "fixed": "xfail",
            "fixed-unmarked": "xfail",
            "broke-marked": "pass",
            "still": "xfail",
            "was-xpass": "xpass",
            "unmarked": "xfail",
        },
    )
    new = run(
        "new",
        {
            "fixed": "xpass",
            "fixed-unmarked": "pass",
            "broke-marked": "xfail",
            "still": "xfail",
            "was-xpass": "fail",
            "unmarked": "fail",
        },
    )
    result = compare_runs(base, new, 10.0, 5.0)
    table, regressions = result.table, result.regressions
    change = dict(zip(table["case_id"], table["change"]))
    assert change == {
        "fixed": "xfail -> xpass: known failure now passes: remove its KnownFailure mark",
        "fixed-unmarked": "xfail -> pass: known failure fixed",
        "broke-marked": "REGRESSION: pass -> xfail (passed in BASE, a known failure in NEW)",
        "was-xpass": "REGRESSION: xpass -> fail",
        "unmarked": "xfail -> fail: known failure no longer marked",
    }
    assert regressions == 2
    proc = cli("compare", str(base), str(new))
    assert proc.returncode == 1 and "**2 regression(s)**" in proc.stdout


def test_the_dashboard_counts_known_failures_per_run(seeded_run):
    run_dir, _ = seeded_run
    runs, rows = load_runs([run_dir])
    table = status_counts(runs, rows)
    assert (int(table["xfail"][0]), int(table["xpass"][0])) == (4, 4)


# ---- the plan resolves a case's mark per item ------------------------------------------------------------------

KNOWN = FIXTURES / "known_failures" / "known_failing.py"  # an external suite: a marked op with a known defect
FIXTURE_REASON, FIXTURE_REFERENCE = (
    "partial row sums are never all-reduced over TP",
    "https://example.org/known_failing/issues/1",
)


def _plan(**over) -> Plan:
    args = dict(
        run_id="p",
        suites_wanted=[],
        ops=[],
        case_patterns=[],
        world_sizes=None,
        topologies=[Topology(1, 1, 1), Topology(1, 1, 2)],
        dtypes=["float64", "float32"],
        impl={},
        quick=True,
        settings=RunSettings(device="cpu", backend="gloo", timeout=60.0, seed=0),
        suite_paths=[str(KNOWN)],
    )
    return build_plan(Selection(**{**args, **over}))


def test_the_plan_resolves_when_per_item_and_plan_json_carries_it():
    plan = _plan()
    marked = {(i.case_id, i.topology, i.dtype): i.xfail for i in plan.items}
    assert len(marked) == 8
    mark = Xfail(FIXTURE_REASON, FIXTURE_REFERENCE, ["*"])
    # known-b4v37 is marked in float64 only (its `when`), fixed-b4v37 everywhere
    assert {k for k, v in marked.items() if v is not None} == {
        ("known-b4v37", (1, 1, 1), "float64"),
        ("known-b4v37", (1, 1, 2), "float64"),
        *(("fixed-b4v37", t, d) for t in ((1, 1, 1), (1, 1, 2)) for d in ("float64", "float32")),
    }
    assert all(v in (None, mark) for v in marked.values())
    again = Plan.from_json(plan.to_json())
    assert [i.xfail for i in again.items] == [i.xfail for i in plan.items]
    assert Xfail("r", "", ["grad:*"]).covers("grad:logits") and not Xfail("r", "", ["grad:*"]).covers("forward")


def _marked(monkeypatch, mark: KnownFailure) -> None:
    """Attach `mark` to DistributedLogprob's cases where the driver plans them."""
    real = plan_module.suite_cases

    def suite_cases(*args, **kwargs):
        return [dataclasses.replace(c, xfail=mark) if c.op == OP else c for c in real(*args, **kwargs)]

    monkeypatch.setattr(plan_module, "suite_cases", suite_cases)


def test_a_mark_that_can_match_no_check_or_whose_when_raises_is_one_usage_line(monkeypatch):
    selection = dict(suites_wanted=["model_utils"], ops=[OP], case_patterns=["b4s6v37-masked0.3"], suite_paths=[])
    _marked(monkeypatch, KnownFailure("typo", checks=("grad:logit",)))
    with pytest.raises(
        UsageError,
        match=r"KnownFailure check pattern 'grad:logit' matches none of its checks "
        r"\(forward, grad:logits",
    ):
        _plan(**selection)
    _marked(monkeypatch, KnownFailure("bad when", when=lambda topology, dtype: topology.pp > 1))
    with pytest.raises(UsageError, match=r"KnownFailure.when\(dp1-cp1-tp1, 'float64'\) raised AttributeError"):
        _plan(**selection)
    with pytest.raises(ValueError, match="needs a reason"):
        KnownFailure("  ")
    assert KnownFailure("r", checks="forward").checks == ("forward",)


# ---- end to end: an external suite with its op's defect marked -------------------------------------------------


def _run(tmp_path, name, *args) -> tuple[Run, ET.Element]:
    xml = tmp_path / f"{name}.xml"
    run = shardcheck(
        "run",
        "--suite-path",
        str(KNOWN),
        "--topology",
        "dp=1,cp=1,tp=2",
        *args,
        "--junit-xml",
        str(xml),
        out=tmp_path / name,
    )
    return run, ET.parse(xml).getroot()


def test_a_known_failure_is_xfail_and_the_run_passes(tmp_path):
    run, xml = _run(tmp_path, "known", "--case", "known-*", "--dtype", "float64")
    assert run.returncode == 0, run.stdout + run.stderr
    assert _status(run.rows, "known-b4v37") == {"forward": "xfail", "grad:x": "pass"}  # the defect is in the values
    known = run.rows[run.rows["status"] == "xfail"].iloc[0]
    assert "> budget" in known["message"] and "failing rank(s): 0, 1" in known["message"]  # the finding, kept
    assert known["message"].endswith(f"; known failure: {FIXTURE_REASON} ({FIXTURE_REFERENCE})")
    assert "shardcheck: 1 passed, 0 warnings, 0 failed, 0 errors, 0 skipped, 1 xfailed, 0 xpassed" in run.stdout
    assert (
        f"Known failures (1 xfail row(s), not failing the run): known_failing.tp_row_sum: {FIXTURE_REASON} "
        f"({FIXTURE_REFERENCE}), 1 row(s)"
    ) in run.stdout
    assert "Findings" not in run.stdout and "rerun:" not in run.stdout  # not printed as a failure
    assert json.loads((run.out / "run.json").read_text())["summary"]["xfail"] == 1
    assert (xml.get("tests"), xml.get("skipped"), xml.get("failures")) == ("1", "1", "0")
    assert xml.find(".//skipped").get("message") == f"known failure: {FIXTURE_REASON} ({FIXTURE_REFERENCE})"
    report = (run.out / "report.md").read_text()
    assert f"**known_failing.tp_row_sum: {FIXTURE_REASON} ({FIXTURE_REFERENCE})**" in report
    assert f"rerun: shardcheck run --suite-path {KNOWN} --suite known_failing" in report


def test_outside_its_when_the_defect_fails_and_a_fixed_one_is_xpass(tmp_path):
    run, xml = _run(tmp_path, "both", "--dtype", "float64,float32")
    assert run.returncode == 1, run.stdout + run.stderr
    rows = run.rows
    assert _status(rows, "known-b4v37") == {"forward": "xfail", "grad:x": "pass"}
    assert _status(rows, "known-b4v37", "float32") == {"forward": "fail", "grad:x": "pass"}  # outside `when`
    for dtype in ("float64", "float32"):  # the mark of the fixed op has no `when`: xpass in both
        assert _status(rows, "fixed-b4v37", dtype) == {"forward": "xpass", "grad:x": "xpass"}
    assert "2 passed, 0 warnings, 1 failed, 0 errors, 0 skipped, 1 xfailed, 4 xpassed" in run.stdout
    assert "FAIL known_failing.tp_row_sum: wrong values" in run.stdout
    assert (
        "XPASS known_failing.tp_row_sum_fixed: a known failure now passes: remove its KnownFailure mark" in run.stdout
    )
    title = "XPASS known_failing.tp_row_sum_fixed [fixed-b4v37] dp1-cp1-tp2 float64"
    assert title in run.stdout
    rerun = run.stdout.split(title)[1].split("\nrerun: ")[1].splitlines()[0]
    assert rerun.startswith(
        f"shardcheck run --suite-path {KNOWN} --suite known_failing --op known_failing.tp_row_sum_fixed"
    )
    assert (xml.get("tests"), xml.get("failures"), xml.get("skipped")) == ("4", "3", "1")
    xpass = [f for f in xml.iter("failure") if f.get("type") == "shardcheck.xpass"]
    assert len(xpass) == 2 and all("now passes on every rank; remove its mark" in f.get("message") for f in xpass)


def test_the_cli_prints_the_rerun_line_of_every_known_failure(seeded_run, capsys):
    from shardcheck.harness.findings.verdicts import findings
    from shardcheck.reports.console import print_findings

    run_dir, _ = seeded_run
    print_findings(findings(load(run_dir)))
    out = capsys.readouterr().out
    known_line = next(i for i, ln in enumerate(out.splitlines()) if ln.startswith("Known failures ("))
    reruns = [
        ln for ln in out.splitlines()[known_line + 1 :] if ln.startswith("  rerun (model_utils.DistributedLogprob): ")
    ]
    assert len(reruns) == len(known_failures(load(run_dir))) >= 1
    assert all(" --op model_utils.DistributedLogprob " in ln for ln in reruns)
