"""Group a run's non-passing rows into causes: what a person would find reading them all by hand.

A cause is one (op, status, kind) where the kind is what went wrong:
- error and hang rows: the exception type, its message with numbers blanked, and where it was
  raised (`RuntimeError: shard check failed (impl.py:23)`);
- failing values: wrong values, non-finite values (NaN/±inf) that differ, a wrong shape or dtype,
  a missing gradient, a failing property;
- warnings: the finding's own words (float64 computed in float32, bfloat16 math, collectives
  beyond the contract, a signature difference).

For each cause, the *condition* separates its rows from the op's passing rows: a conjunction of
predicates over the check, dtype, mesh dims and case parameters, chosen greedily (the predicate
true for every row of the cause that excludes the most passing rows, until none excludes more),
phrased in words ("in grad:logits, when masked ≥ 0.2, at tp ≥ 2").  `exactly` when no passing row
satisfies it.  Skipped rows are consequences (a hang's other items) and are not causes.
"""

from __future__ import annotations

import math
import re
from typing import Callable

import pandas as pd

from harness.compare import STATUS_ORDER

COLUMNS = ["op", "status", "kind", "checks", "count", "condition", "worst", "rerun"]
MESH = ("dp", "cp", "tp")

_RANK_PREFIX = re.compile(r"^rank \d+ \([^)]*\)(?: \(after a peer failed\))?: ")
_LOCATION = re.compile(r"\(([\w.-]+\.py):(\d+)\)")
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")
_WARN_KINDS = ("float64 computed in float32", "bfloat16 math")


def _first_reason(message: str) -> str:
    """The primary rank's reason: the rank prefix and the list of failing ranks removed."""
    text = _RANK_PREFIX.sub("", str(message or ""))
    for tail in ("; failing rank(s)", "; no result from rank(s)"):
        text = text.split(tail)[0]
    return text


def error_template(message: str) -> str:
    """An error message with its numbers blanked (ranks, shapes, seconds) and its location kept."""
    text = _first_reason(message)
    locations = _LOCATION.findall(text)
    text = _NUMBER.sub("N", _LOCATION.sub("(@)", text))
    for file, line in locations:
        text = text.replace("(@)", f"({file}:{line})", 1)
    return text[:160]


def kind_of(row: pd.Series) -> str:
    """What went wrong in one non-passing row, in a few words (rows with the same kind may share a cause)."""
    check, status = row["check"], row["status"]
    reason = _first_reason(row.get("message"))
    if status == "error":
        return error_template(row.get("message"))
    if check == "property:signature":
        return reason
    if check == "property:comm":
        return "more collectives than the contract allows" if status == "warn" else "communication contract failed"
    if check.startswith("property:"):
        return f"{check} does not hold"
    for words in _WARN_KINDS:
        if reason.startswith(words):
            return words + (", OPS.md asks for float32" if words == "bfloat16 math" else "")
    mismatch = row.get("mismatch") if isinstance(row.get("mismatch"), dict) else {}
    if reason.startswith("dtype "):
        return "wrong dtype (" + reason.split(";")[0] + ")"
    if mismatch.get("kind") == "nonfinite":
        return "non-finite values differ (NaN/±inf)"
    if mismatch.get("kind") == "shape":
        return "wrong shape"
    if reason.startswith("no gradient"):
        return "no gradient"
    return "wrong values"


Predicate = tuple[str, float, Callable[[pd.Series], bool]]  # (words, order: lower is preferred, test on a row)


def _predicates(rows: pd.DataFrame) -> list[Predicate]:
    """Candidate conditions from the values these rows take: check, dtype, mesh dims, case parameters."""
    out: list[Predicate] = []
    for check in sorted(rows["check"].unique()):
        out.append((f"in {check}", 0, lambda r, c=check: r["check"] == c))
    if rows["check"].str.startswith("grad:").any():
        out.append(("in the gradients", 0, lambda r: str(r["check"]).startswith("grad:")))
    for dtype in sorted(rows["dtype"].unique()):
        out.append((f"in {dtype}", 1, lambda r, d=dtype: r["dtype"] == d))
    for dim in MESH:
        for v in sorted(rows[dim].unique()):
            if v > 1:
                out.append((f"at {dim} ≥ {v}", 2, lambda r, d=dim, v=v: r[d] >= v))
        out.append((f"at {dim} = 1", 2, lambda r, d=dim: r[d] == 1))
    params = rows["params"].map(lambda p: p if isinstance(p, dict) else {})
    keys = sorted({k for p in params for k in p})
    for key in keys:
        values = {p[key] for p in params if key in p and isinstance(p[key], (bool, int, float, str))}
        numbers = sorted(v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool))
        get = lambda r, k=key: (r["params"] or {}).get(k) if isinstance(r["params"], dict) else None  # noqa: E731
        order = 4 if len(key) == 1 else 3  # sizes (B, S, V) explain less than named conditions (scale, masked)
        if any(isinstance(v, bool) for v in values):
            out.append((f"with {key}", order, lambda r, g=get: g(r) is True))
            out.append((f"without {key}", order, lambda r, g=get: g(r) is not True))
        for v in sorted(v for v in values if isinstance(v, str)):
            out.append((f"with {key} = {v}", order, lambda r, g=get, v=v: g(r) == v))
        for v in numbers:
            num = lambda r, g=get: g(r) if isinstance(g(r), (int, float)) and not isinstance(g(r), bool) else None  # noqa: E731
            out.append((f"when {key} ≥ {v:g}", order, lambda r, n=num, v=v: n(r) is not None and n(r) >= v))
            out.append((f"when {key} ≤ {v:g}", order + 0.5, lambda r, n=num, v=v: n(r) is not None and n(r) <= v))
            if v == 0:
                out.append((f"when {key} = 0 or unset", order, lambda r, n=num: not n(r)))
    return out


def separating_condition(bad: pd.DataFrame, passing: pd.DataFrame) -> str:
    """Words for the predicates that hold on every row of `bad` and exclude the most of `passing`."""
    candidates = [p for p in _predicates(pd.concat([bad, passing])) if bad.apply(p[2], axis=1).all()]
    chosen: list[Predicate] = []
    left = passing
    while len(left):
        scored = [(int((~left.apply(p[2], axis=1)).sum()), p) for p in candidates if p not in chosen]
        scored = [(n, p) for n, p in scored if n > 0]
        if not scored:
            break
        _, best = max(scored, key=lambda s: (s[0], -s[1][1]))
        chosen.append(best)
        left = left[left.apply(best[2], axis=1)]
    chosen.sort(key=lambda p: p[1])
    topologies = sorted({f"dp{r.dp}-cp{r.cp}-tp{r.tp}" for r in bad.itertuples()})
    where = [] if any(p[1] == 2 for p in chosen) else (
        [f"at every topology ({', '.join(topologies)})"] if len(topologies) > 1 else [f"at {topologies[0]}"])
    words = ", ".join([p[0] for p in chosen] + where)
    if not chosen:
        return f"always (every case, dtype and check run), {words}"
    if not len(left):
        return f"exactly {words}"
    return f"mostly {words} ({len(left)} of {len(passing)} passing rows match too)"


def _ratio(row: pd.Series) -> float:
    r = row.get("err_ratio")
    return math.inf if r is None or (isinstance(r, float) and math.isnan(r)) else float(r)


def causes(df: pd.DataFrame) -> pd.DataFrame:
    """One row per cause of a run's non-passing rows (COLUMNS), errors first, then failures, then warnings."""
    if not len(df) or "status" not in df:
        return pd.DataFrame(columns=COLUMNS)
    df = df[df["check"] != "bench"] if "check" in df else df
    bad = df[df["status"].isin(["warn", "fail", "error"])]
    if not len(bad):
        return pd.DataFrame(columns=COLUMNS)
    bad = bad.assign(kind=bad.apply(kind_of, axis=1))
    out = []
    for (op, status, kind), rows in bad.groupby(["op", "status", "kind"], sort=False):
        passing = df[(df["op"] == op) & (df["status"] == "pass")]
        worst = max((r for _, r in rows.iterrows()), key=_ratio)
        ratio = _ratio(worst)
        text = _first_reason(worst["message"])
        if status != "error":
            text = (f"err/budget {ratio:.3g}: " if math.isfinite(ratio) else "") + text
        rerun = worst.get("rerun") if isinstance(worst.get("rerun"), str) else next(
            (r for r in rows.get("rerun", pd.Series(dtype=object)) if isinstance(r, str)), None)
        out.append({"op": op, "status": status, "kind": kind,
                    "checks": ", ".join(sorted(rows["check"].unique())), "count": len(rows),
                    "condition": separating_condition(rows, passing), "worst": text[:300], "rerun": rerun})
    table = pd.DataFrame(out, columns=COLUMNS)
    order = table["status"].map(STATUS_ORDER)
    return table.assign(_o=-order, _n=-table["count"]).sort_values(["_o", "_n", "op"]).drop(columns=["_o", "_n"]).reset_index(drop=True)


def finding_lines(table: pd.DataFrame) -> list[str]:
    """The findings as a person reads them: one line per cause, its worst mismatch and its rerun line."""
    lines = []
    for r in table.itertuples():
        lines.append(f"{r.status.upper()} {r.op}: {r.kind} — {r.condition}; {r.checks}; {r.count} row(s)")
        lines.append(f"    worst: {r.worst}")
        if isinstance(r.rerun, str):
            lines.append(f"    rerun: {r.rerun}")
    return lines
