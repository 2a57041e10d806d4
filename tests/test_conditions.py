"""Conditions from evidence (issue 31, part 4): a condition on a findings line separates the failing items from the
passing items that ran; one that does not separate is not printed, and items a hang's budget skipped never count."""

from __future__ import annotations

import pandas as pd

from shardcheck.harness.findings.causes import causes
from shardcheck.harness.findings.conditions import separating_condition

HANG_SKIP = "not run: the op hung at this topology before (--no-hang-budget runs it anyway)"


def _row(
    status: str,
    case_id: str,
    cp: int,
    positions: str,
    check: str = "forward",
    dtype: str = "float64",
    message: str = "",
) -> dict:
    symptom = {"fail": "values", "error": "hung"}.get(status)
    return {
        "op": "model_utils_cp.Y",
        "case_id": case_id,
        "status": status,
        "check": check,
        "dp": 1,
        "cp": cp,
        "tp": 1,
        "dtype": dtype,
        "params": {"B": 2, "S": 16, "positions": positions},
        "message": message,
        "err_ratio": 9.0 if status == "fail" else None,
        "mismatch": None,
        "rerun": None,
        "symptom": symptom,
        "culprit_ranks": [0] if symptom else [],
        "blocked_ranks": [],
        "error_type": None,
        "error_message": None,
        "error_where": None,
        "phase": "forward" if symptom == "hung" else None,
    }


def _checks(status: str, case_id: str, cp: int, positions: str, dtype: str = "float64") -> list[dict]:
    return [_row(status, case_id, cp, positions, check, dtype) for check in ("forward", "grad:logits")]


def test_a_trigger_the_features_do_not_see_gives_no_condition_not_a_misleading_one():
    """The trigger is a loss_mask with padding (no case parameter says so): the failing items are all at cp ≥ 2 with
    positions = none, and so are passing items of the same topologies and dtypes.  "exactly at cp ≥ 2, with positions
    = none" would point away from the cause: no condition is printed."""
    rows = []
    for cp in (2, 4):
        for dtype in ("float64", "float32"):
            rows += _checks("fail", "padded-loss-mask", cp, "none", dtype)  # the trigger: its loss_mask pads
            rows += _checks("pass", "full-loss-mask", cp, "none", dtype)  # the same parameters, no padding
            rows += _checks("pass", "given-positions", cp, "given", dtype)
    for dtype in ("float64", "float32"):
        rows += _checks("pass", "padded-loss-mask", 1, "none", dtype)
        rows += _checks("pass", "full-loss-mask", 1, "none", dtype)
    table = causes(pd.DataFrame(rows))
    assert len(table) == 1
    condition = table.iloc[0]["condition"]
    assert condition.startswith("no condition on checks, dtypes, mesh dims or case parameters separates it"), condition
    assert "cp ≥ 2" not in condition and "positions" not in condition


def test_a_condition_that_separates_the_items_is_printed_exactly():
    """The same rows without the passing look-alike: cp ≥ 2 with positions = none now does separate."""
    rows = []
    for cp in (2, 4):
        rows += _checks("fail", "padded-loss-mask", cp, "none")
        rows += _checks("pass", "given-positions", cp, "given")
    rows += _checks("pass", "padded-loss-mask", 1, "none")
    condition = causes(pd.DataFrame(rows)).iloc[0]["condition"]
    assert condition.startswith("exactly at cp ≥ 2, with positions = none"), condition


def test_the_other_checks_of_a_failing_item_are_not_evidence_against_its_condition():
    """A forward wrong at cp ≥ 2 whose item's gradient passes beside it: the condition is the items', not
    'no condition' because of that passing gradient row (item-level evidence)."""
    rows = [_row("fail", "a", cp, "none", "forward") for cp in (2, 4)]
    rows += [_row("pass", "a", cp, "none", "property:comm") for cp in (2, 4)]
    rows += [_row("pass", "a", 1, "none", check) for check in ("forward", "property:comm")]
    bad, passing = pd.DataFrame(rows[:2]), pd.DataFrame(rows[2:])
    assert separating_condition(bad, passing, by_check=False) == "exactly at cp ≥ 2"


def test_items_a_hang_budget_skipped_never_count_as_evidence():
    """At cp 2 the op hung in one item; the budget skipped the others there.  The skipped items neither pass nor fail:
    the condition is from the items that ran, and the line says how many were skipped (they may show it too)."""
    rows = [_row("error", "scale30", 2, "none", "forward")]
    rows += [
        _row("skip", case, 2, "none", check, message=HANG_SKIP)
        for case in ("scale10", "scale20")
        for check in ("forward", "grad:logits")
    ]
    rows += _checks("pass", "scale10", 1, "none") + _checks("pass", "scale20", 1, "none")
    rows += _checks("pass", "scale30", 1, "none")
    table = causes(pd.DataFrame(rows))
    assert len(table) == 1
    condition = table.iloc[0]["condition"]
    assert condition.startswith("exactly at cp ≥ 2"), condition  # not "when scale ≥ 30": scale10/20 never ran at cp 2
    assert "2 item(s) at dp1-cp2-tp1 float64 were skipped after a hang and may show it too" in condition


def test_skipped_items_would_have_been_passing_rows_and_are_not():
    """The skipped rows are not passing rows: with them counted as passing, "at cp ≥ 2" would not separate."""
    bad = pd.DataFrame([_row("fail", "s30", 2, "none")])
    ran = pd.DataFrame([_row("pass", "s30", 1, "none"), _row("pass", "s10", 1, "none")])
    assert separating_condition(bad, ran).startswith("exactly at cp ≥ 2")
    with_skipped = pd.concat([ran, pd.DataFrame([_row("pass", "s10", 2, "none")])])
    assert not separating_condition(bad, with_skipped).startswith("exactly at cp ≥ 2")


def test_a_signature_row_lends_a_finding_no_topology():
    """A signature row is of the module, found before any rank ran (recorded at dp0-cp0-tp0): the topologies a
    finding names are those of the rows that ran."""
    signature = {**_row("fail", "signature", 0, "none", check="property:signature"), "dp": 0, "tp": 0}
    bad = pd.DataFrame([_row("fail", "c", 2, "none"), signature])
    condition = separating_condition(bad, bad.iloc[:0])
    assert condition.endswith(", at dp1-cp2-tp1"), condition
    assert separating_condition(pd.DataFrame([signature]), bad.iloc[:0]).endswith(", at dp0-cp0-tp0")  # none ran


def test_a_condition_never_cites_a_dtype_whose_items_a_hang_budget_skipped():
    """Issue 42, item 6: float64 fails at cp 1 and 2; float32 passes at cp 1 but at cp 2 the budget skipped it after a
    hang.  "in float64" would cite what never ran at cp 2 (the float32 items there may fail too): not said."""
    rows = [_row("fail", "a", cp, "head_tail", "forward") for cp in (1, 2)]
    rows += [_row("error", "hangs", 2, "none", "forward")]
    rows += [_row("skip", "a", 2, "head_tail", "forward", "float32", HANG_SKIP)]
    rows += [_row("pass", "a", 1, "head_tail", "forward", "float32")]
    rows += [_row("pass", "b", cp, "none", "forward") for cp in (1, 2)]
    table = causes(pd.DataFrame(rows))
    line = table[table["kind"] == "wrong values"].iloc[0]
    assert "float64" not in line["condition"].split(" (from the items that ran")[0], line["condition"]
    assert "1 item(s) at dp1-cp2-tp1 float32 were skipped after a hang" in line["condition"]


def test_a_trigger_that_is_a_product_of_mesh_dims_is_said_as_one():
    """Issue 42, item 6: wrong wherever a rank holds a piece of the batch of another DP·CP rank (dp·cp ≥ 2), right at
    dp = cp = 1: no single mesh dim separates it (dp ≥ 2 misses dp1-cp2, cp ≥ 2 misses dp2-cp1); the product does."""
    where = [(2, 1), (1, 2), (2, 2)]
    bad = pd.DataFrame([{**_row("fail", "a", cp, "none"), "dp": dp} for dp, cp in where])
    passing = pd.DataFrame([_row("pass", "a", 1, "none")] + [{**_row("pass", "a", 1, "none"), "tp": 2}])
    assert separating_condition(bad, passing) == "exactly at dp·cp ≥ 2"
    # where one dim separates as well, the single dim is said
    assert separating_condition(bad[bad["cp"] == 2], passing.assign(dp=2)) == "exactly at cp ≥ 2"
