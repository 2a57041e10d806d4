"""A results frame's rows as dicts, taken once per frame: pandas' `to_dict("records")` reads every column again on
each call, and the findings asked it per symptom (seconds per failing model run, hundreds of symptoms)."""

from __future__ import annotations

import pandas as pd


def records(df: pd.DataFrame) -> list[dict]:
    """`df.to_dict("records")`, the same values (Python scalars), read column by column once."""
    columns = list(df.columns)
    return [dict(zip(columns, values)) for values in zip(*(df[c].tolist() for c in columns))]


class RowDicts:
    """The rows of one frame as dicts, by index label: `self(rows)` for any frame of its rows, in their order."""

    def __init__(self, df: pd.DataFrame):
        self._of = dict(zip(df.index, records(df)))

    def __call__(self, rows: pd.DataFrame) -> list[dict]:
        return [self._of[i] for i in rows.index]


def rules_of(records: list[dict]) -> dict:
    """The rules rows were judged under ((source, cite) -> None, in order): where each comes from."""
    return dict.fromkeys(
        (r["rule_source"], r["rule_cite"])
        for r in records
        if pd.notna(r.get("rule_source")) and pd.notna(r.get("rule_cite"))
    )
