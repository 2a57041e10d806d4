"""The items a hang's budget skipped (harness/driver/launch.py words them; not those a case or plan skips): what a
findings line's condition cannot see.  Its condition must hold on them too (they may show the symptom, so it never
cites a dtype or a case they had), and the line says how many there were (shardcheck.harness.findings.causes, 2)."""

from __future__ import annotations

import pandas as pd

from shardcheck.harness.core.records import Status, with_mesh_splits
from shardcheck.harness.core.topology import topology_label
from shardcheck.harness.findings.conditions import ITEM


def skipped_by_hangs(df: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """op -> the rows of its items a hang's budget skipped (every check of each)."""
    skipped = df[
        (df["status"] == Status.SKIP) & df["message"].astype(str).str.contains("--no-hang-budget", regex=False)
    ]
    return {op: rows for op, rows in skipped.groupby("op", sort=False)}


def skipped_like(rows: pd.DataFrame, skipped: pd.DataFrame | None) -> pd.DataFrame | None:
    """The skipped rows at the symptom's topologies, of its checks: the rows its condition must hold on too."""
    if skipped is None or not len(skipped):
        return None
    where = {topology_label(r) for r in rows.to_dict("records")}
    like = skipped[[topology_label(r) in where for r in skipped.to_dict("records")]]
    like = like[like["check"].isin(set(rows["check"]))] if "check" in like else like
    return like if len(like) else None


def not_run(rows: pd.DataFrame, skipped: pd.DataFrame | None) -> str:
    """What a condition cannot say: the op's items at the symptom's topologies that never ran (a hang's budget skips
    the op's other items at its topology, every dtype).  The condition is from the items that ran; those may show
    the symptom too."""
    if skipped is None or not len(skipped):
        return ""
    where = {topology_label(r) for r in rows.to_dict("records")}
    items = with_mesh_splits(skipped).drop_duplicates(ITEM).to_dict("records")
    gone = [r for r in items if topology_label(r) in where]
    if not gone:
        return ""
    topologies = sorted({f"{topology_label(r)} {r['dtype']}" for r in gone})
    return (
        f" (from the items that ran: {len(gone)} item(s) at {', '.join(topologies)} were skipped after a hang "
        f"and may show it too)"
    )
