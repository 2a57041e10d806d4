"""JUnit XML: one testcase per item, failures/errors/skips counted right, readable by the stdlib parser."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pandas as pd

from shardcheck.harness.cli import main
from shardcheck.reports.junit import junit_tree


def _row(
    case_id, check, status, op="model_utils.DistributedLogprob", tp=2, dtype="float64", message="", rerun=None, **cause
):
    return {
        "op": op,
        "case_id": case_id,
        "dp": 1,
        "cp": 1,
        "tp": tp,
        "dtype": dtype,
        "check": check,
        "status": status,
        "message": message,
        "rerun": rerun,
        "item_seconds": 0.25,
        "symptom": {"fail": "values", "error": "died"}.get(status),
        "error_type": None,
        **cause,
    }


def test_one_testcase_per_item_with_counts_messages_and_reasons():
    df = pd.DataFrame(
        [
            _row("a", "forward", "pass"),
            _row("a", "grad:logits", "pass"),
            _row("b", "forward", "pass"),
            _row(
                "b",
                "grad:logits",
                "fail",
                message="rank 1: |err| 2.07 > budget",
                rerun="shardcheck run --op model_utils.DistributedLogprob --case b",
            ),
            _row("c", "forward", "error", message="rank 1 died: SIGKILL", rerun="shardcheck run --case c"),
            _row("c", "grad:logits", "error", message="rank 1 died: SIGKILL", rerun="shardcheck run --case c"),
            _row("d", "forward", "skip", message="skipped: model_utils.DistributedLogprob hung in case c float64"),
            _row("a", "forward", "pass", dtype="float32"),
            _row("x", "forward", "fail", op="kd_loss.KDLoss", tp=1, message="bad", rerun="shardcheck run --case x"),
        ]
    )
    root = ET.fromstring(ET.tostring(junit_tree(df, "run1").getroot()))
    assert root.tag == "testsuites"
    assert {k: root.get(k) for k in ("tests", "failures", "errors", "skipped")} == {
        "tests": "6",
        "failures": "2",
        "errors": "1",
        "skipped": "1",
    }
    suites = {s.get("name"): s for s in root.findall("testsuite")}
    assert set(suites) == {"model_utils.DistributedLogprob", "kd_loss.KDLoss"}
    lp = suites["model_utils.DistributedLogprob"]
    assert (lp.get("tests"), lp.get("failures"), lp.get("errors"), lp.get("skipped")) == ("5", "1", "1", "1")
    cases = {c.get("name"): c for c in lp.findall("testcase")}
    assert set(cases) == {
        "a [dp1-cp1-tp2 float64]",
        "b [dp1-cp1-tp2 float64]",
        "c [dp1-cp1-tp2 float64]",
        "d [dp1-cp1-tp2 float64]",
        "a [dp1-cp1-tp2 float32]",
    }
    assert all(c.get("classname") == "model_utils.DistributedLogprob" for c in cases.values())
    assert list(cases["a [dp1-cp1-tp2 float64]"]) == []
    failure = cases["b [dp1-cp1-tp2 float64]"].find("failure")
    assert failure.get("message") == "grad:logits: rank 1: |err| 2.07 > budget"
    assert failure.text.endswith("rerun: shardcheck run --op model_utils.DistributedLogprob --case b")
    error = cases["c [dp1-cp1-tp2 float64]"].find("error")
    assert "rank 1 died: SIGKILL" in error.get("message") and error.text.count("SIGKILL") == 2
    assert cases["d [dp1-cp1-tp2 float64]"].find("skipped").get("message").startswith("skipped: model_utils")
    assert float(cases["b [dp1-cp1-tp2 float64]"].get("time")) == 0.25
    # the type says what went wrong, read from the row's fields: an exception's own type
    assert (failure.get("type"), error.get("type")) == ("shardcheck.values", "shardcheck.died")
    raised = junit_tree(
        pd.DataFrame(
            [
                _row(
                    "e",
                    "forward",
                    "error",
                    message="rank 0: ValueError: no (x.py:3)",
                    symptom="exception",
                    error_type="ValueError",
                )
            ]
        ),
        "run2",
    ).getroot()
    assert raised.find(".//error").get("type") == "ValueError"


def test_junit_xml_to_a_missing_directory_is_a_usage_error(tmp_path, capsys):
    code = main(
        [
            "run",
            "--op",
            "model_utils.DistributedLogprob",
            "--junit-xml",
            str(tmp_path / "nope" / "j.xml"),
            "--out",
            str(tmp_path / "run"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--junit-xml" in err and "does not exist" in err
    assert not (tmp_path / "run").exists()  # refused before anything ran


def test_junit_xml_to_a_directory_is_a_usage_error(tmp_path, capsys):
    code = main(["run", "--junit-xml", str(tmp_path), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "is a directory" in err and len(err.strip().splitlines()) == 1
