"""The CLI's failing items (reports/console.py, print_failures): an item that errors fails every one of its checks
with one message; the line names the first few and counts the rest (report.md and results.jsonl keep them all)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from shardcheck.reports.console import print_failures


def test_an_error_items_checks_are_folded_into_a_short_line(capsys):
    checks = ["forward"] + [f"forward:act{i:02d}:layers.{i}.mlp" for i in range(130)]
    rows = pd.DataFrame(
        {
            "op": "decoder_tp.parallelize",
            "case_id": "mha",
            "dp": 1,
            "cp": 1,
            "tp": 2,
            "dtype": "float64",
            "check": checks,
            "status": "error",
            "message": "RuntimeError: shapes differ",
            "rerun": "shardcheck run --case mha",
        }
    )
    print_failures(Path("run"), rows)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "ERROR decoder_tp.parallelize [mha] dp1-cp1-tp2 float64"
    assert lines[1] == (
        "  forward, forward:act00:layers.0.mlp, forward:act01:layers.1.mlp, forward:act02:layers.2.mlp, "
        "forward:act03:layers.3.mlp, forward:act04:layers.4.mlp and 125 more checks: RuntimeError: shapes differ"
    )
    assert lines[2] == "rerun: shardcheck run --case mha" and len(lines) == 3
