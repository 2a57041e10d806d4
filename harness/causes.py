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

from harness.compare import NOT_PASSING, PRECISION_WARNINGS, STATUS_ORDER
from harness.signatures import SIGNATURE_CHECK

COLUMNS = ["op", "status", "kind", "checks", "count", "condition", "worst", "rerun"]
MESH = ("dp", "cp", "tp")
ITEM = ["case_id", "dp", "cp", "tp", "dtype"]

_RANK_PREFIX = re.compile(r"^rank \d+ \([^)]*\)(?: \(after a peer failed\))?: ")
_LOCATION = re.compile(r"\(([\w.-]+\.py):(\d+)\)")
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")
_DIED = re.compile(r"rank \d+ died: [^;()]+")
_HUNG = re.compile(r"rank\(s\) [\d, ]+ did not finish the case within [\d.]+s")


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
    if status == "error":  # a death or a hang is the item's cause, whatever each check's rank reported
        message = str(row.get("message") or "")
        for pattern in (_DIED, _HUNG):
            found = pattern.search(message)
            if found:
                return _NUMBER.sub("N", found.group(0)) + (" (blocked in a collective or dead)" if pattern is _HUNG else "")
        return error_template(message)
    if check == "property:signature":
        return reason
    if check == "property:comm":
        return "more collectives than the contract allows" if status == "warn" else "communication contract failed"
    if check.startswith("property:"):
        return f"{check} does not hold"
    for words in PRECISION_WARNINGS:
        if reason.startswith(words):
            return words + (", docs/ops/README.md asks for float32" if words == "bfloat16 math" else "")
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


def _predicates(rows: pd.DataFrame, by_check: bool = True) -> list[Predicate]:
    """Candidate conditions from the values these rows take: check, dtype, mesh dims, case parameters."""
    out: list[Predicate] = []
    for check in sorted(rows["check"].unique()) if by_check else []:
        out.append((f"in {check}", 0, lambda r, c=check: r["check"] == c))
    if by_check and rows["check"].str.startswith("grad:").any():
        out.append(("in the gradients", 0, lambda r: str(r["check"]).startswith("grad:")))
    if by_check and rows["check"].str.startswith("property:").any():
        out.append(("in values and gradients", 0, lambda r: not str(r["check"]).startswith("property:")))
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
            if any(v is False for v in values):  # set to False, as against not a parameter of the case at all
                out.append((f"with {key} = False", order, lambda r, g=get: g(r) is False))
        for v in sorted(v for v in values if isinstance(v, str)):
            out.append((f"with {key} = {v}", order, lambda r, g=get, v=v: g(r) == v))
            out.append((f"with {key} ≠ {v}", order + 0.5, lambda r, g=get, v=v: g(r) is not None and g(r) != v))
        for v in numbers:
            num = lambda r, g=get: g(r) if isinstance(g(r), (int, float)) and not isinstance(g(r), bool) else None  # noqa: E731
            out.append((f"when {key} ≥ {v:g}", order, lambda r, n=num, v=v: n(r) is not None and n(r) >= v))
            out.append((f"when {key} ≤ {v:g}", order + 0.5, lambda r, n=num, v=v: n(r) is not None and n(r) <= v))
            if v == 0:
                out.append((f"when {key} = 0 or unset", order, lambda r, n=num: not n(r)))
    return out


def separating_condition(bad: pd.DataFrame, passing: pd.DataFrame, by_check: bool = True) -> str:
    """Words for the predicates that hold on every row of `bad` and exclude the most of `passing`."""
    candidates = [p for p in _predicates(pd.concat([bad, passing]), by_check) if bad.apply(p[2], axis=1).all()]
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
    bad = df[df["status"].isin(NOT_PASSING)]
    if not len(bad):
        return pd.DataFrame(columns=COLUMNS)
    bad = bad.assign(kind=bad.apply(kind_of, axis=1))
    out = []
    for (op, status, kind), rows in bad.groupby(["op", "status", "kind"], sort=False):
        passing = df[(df["op"] == op) & (df["status"] == "pass")]
        worst = max((r for _, r in rows.iterrows()), key=_ratio)
        ratio = _ratio(worst)
        text = _first_reason(worst["message"])
        death_or_hang = _DIED.search(str(worst["message"])) or _HUNG.search(str(worst["message"]))
        if status == "error" and death_or_hang and death_or_hang.group(0) not in text:  # the cause before its echoes
            text = f"{death_or_hang.group(0)}; the first report: {text}"
        if status != "error":
            text = (f"err/budget {ratio:.3g}: " if math.isfinite(ratio) else "") + text
        rerun = worst.get("rerun") if isinstance(worst.get("rerun"), str) else next(
            (r for r in rows.get("rerun", pd.Series(dtype=object)) if isinstance(r, str)), None)
        out.append({"op": op, "status": status, "kind": kind,
                    "checks": ", ".join(sorted(rows["check"].unique())), "count": len(rows),
                    "condition": ("of the module, found before any case ran" if (rows["check"] == SIGNATURE_CHECK).all()
                                  else separating_condition(rows, passing)), "worst": text[:300], "rerun": rerun,
                    "_rows": list(rows.index), "_items": set(map(tuple, rows[ITEM].astype(str).values))})
    table = _merge_common_trigger(pd.DataFrame(out), bad, df)
    order = table["status"].map(STATUS_ORDER)
    return table.assign(_o=-order, _n=-table["count"]).sort_values(["_o", "_n", "op"]).drop(columns=["_o", "_n"]).reset_index(drop=True)


def _merge(group: pd.DataFrame, condition: str) -> dict:
    first = group.iloc[0]
    return {**first.to_dict(), "status": max(group["status"], key=STATUS_ORDER.__getitem__),
            "kind": "; ".join(group["kind"]), "count": int(group["count"].sum()),
            "checks": ", ".join(sorted({c for cs in group["checks"] for c in cs.split(", ")})), "condition": condition}


def _components(failing: pd.DataFrame) -> list[list[int]]:
    """Positions in `failing` grouped by shared items (connected components), at most one crash each."""
    groups: list[list[int]] = []
    for i in range(len(failing)):
        items = failing.iloc[i]["_items"]
        joined = [g for g in groups if any(items & failing.iloc[j]["_items"] for j in g)]
        merged = [i] + [j for g in joined for j in g]
        if sum(failing.iloc[j]["status"] == "error" for j in merged) > 1:  # two different crashes: two causes
            groups.append([i])
            continue
        groups = [g for g in groups if g not in joined] + [merged]
    return groups


def _merge_common_trigger(table: pd.DataFrame, bad: pd.DataFrame, df: pd.DataFrame) -> pd.DataFrame:
    """An op's failing causes (fail, error) are symptoms of one bug (a crash in one check, a broken
    property in another) when one condition on the inputs and topology separates their items (case,
    topology, dtype) exactly from the op's clean items, or no clean item tells them apart, or they
    fail in the same items.  Two different crashes stay two causes."""
    out = []
    for op, causes_of_op in table.groupby("op", sort=False):
        failing = causes_of_op[causes_of_op["status"].isin(["fail", "error"])]
        warnings = causes_of_op[causes_of_op["status"] == "warn"]
        passing = df[(df["op"] == op) & (df["status"] == "pass")]
        if len(failing) > 1 and (failing["status"] == "error").sum() <= 1:
            rows = df[df["op"] == op]
            is_bad = rows["status"].isin(["fail", "error"]).groupby([rows[k] for k in ITEM]).transform("any")
            items = rows.drop_duplicates(ITEM)
            dirty = rows["status"].isin(NOT_PASSING).groupby([rows[k] for k in ITEM]).transform("any")
            clean = items[~dirty.loc[items.index]]
            condition = separating_condition(items[is_bad.loc[items.index]], clean, by_check=False)
            if condition.startswith("exactly") or not len(clean):  # nothing tells two triggers apart
                out.append(pd.concat([pd.DataFrame([_merge(failing, condition)]), warnings]))
                continue
        merged = []
        for component in _components(failing):
            group = failing.iloc[component]
            if len(group) == 1:
                merged.append(group.iloc[0].to_dict())
            else:
                rows = df.loc[[i for ix in group["_rows"] for i in ix]]
                merged.append(_merge(group, separating_condition(rows, passing)))
        out.append(pd.concat([pd.DataFrame(merged, columns=failing.columns), warnings]))
    return pd.concat(out, ignore_index=True)[COLUMNS]


def finding_lines(table: pd.DataFrame) -> list[str]:
    """The findings as a person reads them: one line per cause, its worst mismatch and its rerun line."""
    lines = []
    for r in table.itertuples():
        lines.append(f"{r.status.upper()} {r.op}: {r.kind} — {r.condition}; {r.checks}; {r.count} row(s)")
        lines.append(f"    worst: {r.worst}")
        if isinstance(r.rerun, str):
            lines.append(f"    rerun: {r.rerun}")
    return lines
