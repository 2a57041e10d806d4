"""What a run selected, read from its rows: `compare` and the dashboard judge two runs of different selections
(suites, ops, cases, --quick, world sizes, dtypes, devices, --bench) on what both ran.

A run records its selection only as the checks it ran, so a selection is the set of ops, (op, case) pairs, world
sizes, dtypes and devices found in its rows.  Rows that belong to no topology (world size 0: an op whose signature
drifted, found before any case ran) and dtype "-" say nothing about world sizes or dtypes.  An op whose rows are
only such rows ran none of its cases: every case of it counts as selected, so the checks that a signature failure
kept from running count as not run, not as a narrower selection.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

NO_DTYPE = "-"  # the dtype of a row that belongs to no case (the signature check)
BENCH_CHECK = "bench"


def world_sizes(rows: pd.DataFrame) -> pd.Series:
    """Each row's world size: its `world_size`, or dp × cp × tp where the row does not carry it."""
    product = rows["dp"].astype(int) * rows["cp"].astype(int) * rows["tp"].astype(int)
    if "world_size" not in rows:
        return product
    return pd.to_numeric(rows["world_size"], errors="coerce").fillna(product).astype(int)


@dataclass(frozen=True)
class Selection:
    ops: frozenset[str]
    cases: frozenset[tuple[str, str]]  # (op, case_id) of every row
    ops_with_cases: frozenset[str]  # ops that ran at least one case at a topology
    world_sizes: frozenset[int]
    dtypes: frozenset[str]
    devices: frozenset[str]
    device_names: frozenset[str]  # the dashboard's rows carry run.json's device name: another machine, another line
    bench: bool  # the run measured (--bench)

    @classmethod
    def of(cls, rows: pd.DataFrame) -> Selection:
        sizes = world_sizes(rows)
        return cls(
            ops=frozenset(rows["op"]),
            cases=frozenset(zip(rows["op"], rows["case_id"])),
            ops_with_cases=frozenset(rows.loc[sizes > 0, "op"]),
            world_sizes=frozenset(int(s) for s in sizes if s > 0),
            dtypes=frozenset(rows["dtype"]) - {NO_DTYPE},
            devices=frozenset(rows["device"]),
            device_names=frozenset(rows["device_name"]) if "device_name" in rows else frozenset(),
            bench=bool((rows["check"] == BENCH_CHECK).any()),
        )

    def covers(self, rows: pd.DataFrame) -> pd.Series:
        """Per row (of the other run): whether this selection would have run its check."""
        sizes = world_sizes(rows)
        case = pd.Series(
            [(op, c) in self.cases or op not in self.ops_with_cases for op, c in zip(rows["op"], rows["case_id"])],
            index=rows.index,
            dtype=bool,
        )
        case |= sizes == 0  # a check of the op as a whole (its signature): selected with the op
        size = (sizes == 0) | sizes.isin(self.world_sizes) | (not self.world_sizes)
        dtype = (rows["dtype"] == NO_DTYPE) | rows["dtype"].isin(self.dtypes) | (not self.dtypes)
        bench = (rows["check"] != BENCH_CHECK) | self.bench
        device = rows["device"].isin(self.devices)
        if self.device_names and "device_name" in rows:
            device &= rows["device_name"].isin(self.device_names)
        return rows["op"].isin(self.ops) & case & size & dtype & device & bench


def few(names: list[str], shown: int = 4) -> str:
    """A list of names, the first few of a long one."""
    if len(names) <= shown + 1:
        return ", ".join(names)
    return ", ".join(names[:shown]) + f" and {len(names) - shown} more"


def only_one_side(base: pd.DataFrame, new: pd.DataFrame) -> str | None:
    """One line saying what only one of the runs ran (not compared), or None when both selected the same."""
    parts = []
    for side, rows, other in (("BASE", base, new), ("NEW", new, base)):
        selection = Selection.of(other)
        outside = rows[~selection.covers(rows)]
        if len(outside):
            parts.append(f"only {side} ran {len(outside)} check(s) ({_what(outside, selection)})")
    if not parts:
        return None
    return "runs of different selections, compared on what both ran: " + "; ".join(parts)


def _what(outside: pd.DataFrame, other: Selection) -> str:
    """What rows of one run have that the other run did not select: its ops, world sizes, dtypes, --bench, cases."""
    sizes = sorted(set(int(s) for s in world_sizes(outside)) - other.world_sizes - {0})
    dtypes = sorted(set(outside["dtype"]) - other.dtypes - {NO_DTYPE})
    ops = sorted(set(outside["op"]) - other.ops)
    what = [f"world size(s) {few([str(s) for s in sizes])}"] if sizes and other.world_sizes else []
    what += [f"dtype(s) {few(dtypes)}"] if dtypes and other.dtypes else []
    what += [f"op(s) {few(ops)}"] if ops else []
    what += ["--bench"] if (outside["check"] == BENCH_CHECK).any() and not other.bench else []
    return ", ".join(what) or f"other cases of {few(sorted(set(outside['op'])))}"
