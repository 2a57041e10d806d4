"""Values exactly a power of a case parameter times the right ones are a root of their own line
(shardcheck.harness.findings.common_factor.scaled_by_parameter): result rows written by hand, no rank runs."""

from __future__ import annotations

import pandas as pd

from shardcheck.harness.findings.causes import causes

T2_LINE = "wrong values, 1/temperature² times the right ones"


def _row(status: str, temperature: float, check: str = "forward", factor: float | None = None, dp: int = 1) -> dict:
    """A row of op kd.Loss at one temperature; a failing row is `factor` times its golden at its worst element."""
    expected = 2.0 + temperature
    mismatch = None
    if factor is not None:
        mismatch = {
            "rank": 0,
            "global_index": None,
            "local_index": None,
            "expected": expected,
            "got": factor * expected,
        }
    return {
        "op": "kd.Loss",
        "case_id": f"T{temperature:g}",
        "status": status,
        "check": check,
        "dp": dp,
        "cp": 1,
        "tp": 1,
        "dtype": "float64",
        "params": {"temperature": temperature, "B": 4},
        "message": "",
        "mismatch": mismatch,
        "max_rel_err": abs(factor - 1) if factor is not None else None,
        "symptom": {"fail": "values", "pass": None}[status] if check != "property:dp_sum" else "property",
        "culprit_ranks": [0],
        "blocked_ranks": [],
    }


def _kinds(rows: list[dict]) -> set[str]:
    return set(causes(pd.DataFrame(rows))["kind"])


def test_a_missing_temperature_factor_is_named_by_its_parameter():
    rows = [_row("fail", t, factor=1 / t**2) for t in (2.0, 0.5)] + [_row("pass", 1.0)]
    assert _kinds(rows) == {T2_LINE}


def test_without_a_passing_item_at_the_parameters_one_it_is_plain_wrong_values():
    """×1/4 at T = 2 could be any bug of that case: only the right answer at T = 1 ties it to T."""
    rows = [_row("fail", t, factor=1 / t**2) for t in (2.0, 0.5)]
    assert _kinds(rows) == {"wrong values"}


def test_one_wrong_value_of_no_such_scale_on_the_check_keeps_it_one_wrong_values_line():
    rows = [_row("fail", 2.0, factor=0.25), _row("fail", 0.5, factor=0.6), _row("pass", 1.0)]
    assert _kinds(rows) == {"wrong values"}


def test_a_property_failing_in_a_scaled_item_is_of_its_line():
    """property:dp_sum holds no tensor to read: where the item's values are 1/T² off, it is the same root."""
    rows = [_row("fail", 2.0, factor=0.25, dp=2), _row("fail", 2.0, check="property:dp_sum", dp=2)]
    rows += [_row("pass", 1.0, dp=2), _row("pass", 1.0, check="property:dp_sum", dp=2)]
    table = causes(pd.DataFrame(rows))
    assert len(table) == 1 and table.iloc[0]["kind"] == T2_LINE, table[["kind", "checks"]]
    assert "property:dp_sum" in table.iloc[0]["checks"]
