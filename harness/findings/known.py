"""A run's known failures (`xfail` rows, shardcheck.KnownFailure): one line per mark."""

from __future__ import annotations

import pandas as pd

from shardcheck.harness.core.records import Status
from shardcheck.harness.findings.wording import display, item_count, where_text

KNOWN_COLUMNS = ["op", "reason", "reference", "checks", "count", "items", "where", "rerun"]


def known_failures(df: pd.DataFrame) -> pd.DataFrame:
    """The run's `xfail` rows, one line per known failure (its reason and reference,
    shardcheck.KnownFailure): the ops and checks it covered, how many rows and items, where
    (topologies, dtypes) and one rerun line."""
    if not len(df) or "status" not in df:
        return pd.DataFrame(columns=KNOWN_COLUMNS)
    rows = df[df["status"] == Status.XFAIL]
    if not len(rows):
        return pd.DataFrame(columns=KNOWN_COLUMNS)
    rows = rows.assign(
        _reason=rows["xfail_reason"].fillna("") if "xfail_reason" in rows else "",
        _reference=rows["xfail_reference"].fillna("") if "xfail_reference" in rows else "",
    )
    out = []
    for (reason, reference), group in rows.groupby(["_reason", "_reference"], sort=False):
        reruns = group["rerun"].dropna() if "rerun" in group else pd.Series(dtype=object)
        out.append(
            {
                "op": display(list(dict.fromkeys(group["op"]))),
                "reason": reason,
                "reference": reference,
                "checks": ", ".join(sorted(group["check"].unique())),
                "count": len(group),
                "items": item_count(group),
                "where": where_text(group),
                "rerun": reruns.iloc[0] if len(reruns) else None,
            }
        )
    return pd.DataFrame(out, columns=KNOWN_COLUMNS)


def known_failure_text(r) -> str:
    """One known failure for people: 'op: reason (reference)'."""
    return f"{r.op}: {r.reason}" + (f" ({r.reference})" if r.reference else "")


def known_failures_line(table: pd.DataFrame) -> str:
    """The known failures of a run in one line, with their reasons (the CLI summary)."""
    total = int(table["count"].sum())
    return f"Known failures ({total} xfail row(s), not failing the run): " + "; ".join(
        f"{known_failure_text(r)}, {r.count} row(s)" for r in table.itertuples()
    )
