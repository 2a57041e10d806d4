"""Scale: what a run at 8 and 16 ranks needs of the harness itself.

- A harness exception on a rank (here: a layout it cannot apply) is an error row naming the exception and the
  harness line, the rank goes on to the next item, and the run says it is the harness's fault.
"""

from __future__ import annotations

from helpers import FIXTURES, ROOT, shardcheck

LAYOUT_CANNOT_APPLY = FIXTURES / "harness" / "layout_cannot_apply.py"


def test_a_harness_exception_is_an_error_row_and_the_next_item_runs(tmp_path):
    run = shardcheck("run", "--suite-path", str(LAYOUT_CANNOT_APPLY), "--topology", "dp=1,cp=2,tp=1",
                     "--dtype", "float64", out=tmp_path / "run", timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    rows = run.rows
    bad = rows[rows["case_id"] == "output_cannot_be_laid_out"]
    assert list(bad["status"]) == ["error"], bad[["check", "status", "message"]]
    row = bad.iloc[0]
    assert row["symptom"] == "harness"
    assert row["error_type"] == "ValueError"
    assert "head-tail layout needs a length divisible by 2·CP = 4, got 6" in row["error_message"]
    # the line of shardcheck's own code that raised, not the op's (the op did nothing wrong)
    case_py = (ROOT / "harness" / "core" / "case.py").read_text().splitlines()
    path, line = row["error_where"].rsplit(":", 1)
    assert path == "harness/core/case.py", row["error_where"]
    assert "raise ValueError(f\"head-tail layout needs" in case_py[int(line) - 1]
    assert sorted(r["rank"] for r in row["per_rank"]) == [0, 1]  # every rank reported it, none died
    assert "a harness defect, not the op's" in row["message"]
    assert row["rerun"].startswith("shardcheck run ")
    # the next item ran on the same ranks and passes
    honest = rows[rows["case_id"] == "honest"]
    assert set(honest["check"]) == {"forward", "grad:x"} and (honest["status"] == "pass").all()
    assert "shardcheck's own fault, not the op's: ValueError" in run.stdout
    assert "raised at harness/core/case.py:" in run.stdout
