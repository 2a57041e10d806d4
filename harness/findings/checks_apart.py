"""Symptoms of one op whose checks were never judged in a common item: apart, one line per such set.

"One bug showing in several checks" (shardcheck.harness.findings.causes, 3) needs items where those checks were judged
together.  A suite's scenarios can have checks of their own (a barrier on a sub-group and a late rank's barrier are
two cases of `_barrier_with_timeout`, judged by different properties): checks that never meet in an item say nothing
of each other, so their failures stay apart however the op's items fail (issue 42, a pre-fix copy's sub-group hang).
"""

from __future__ import annotations

import pandas as pd

from shardcheck.harness.core.records import SIGNATURE_CHECK, Status
from shardcheck.harness.findings.conditions import ITEM


def judged_apart(symptoms: list[dict], rows: pd.DataFrame) -> list[list[dict]]:
    """`symptoms` split into the groups whose checks share an item they were judged in (in order of appearance):
    two symptoms are together when any of the one's checks ran in an item any of the other's ran in."""
    if len(symptoms) < 2:
        return [symptoms]
    ran = rows[(rows["check"] != SIGNATURE_CHECK) & ~rows["status"].isin([Status.SKIP, Status.XFAIL])]
    keys = ran[ITEM].astype(str).apply(tuple, axis=1)
    items_of = {check: set(keys[ran["check"] == check]) for check in ran["check"].unique()}
    groups: list[tuple[list[dict], set]] = []
    for s in symptoms:
        judged = set().union(*(items_of.get(c, set()) for c in s["all_checks"]))
        joined = [g for g in groups if g[1] & judged]
        merged = ([t for g in joined for t in g[0]] + [s], judged.union(*(g[1] for g in joined)))
        groups = [g for g in groups if not any(g is j for j in joined)] + [merged]
    return [g[0] for g in sorted(groups, key=lambda g: min(symptoms.index(t) for t in g[0]))]
