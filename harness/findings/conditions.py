"""The condition that separates a symptom's rows from the passing rows (shardcheck.harness.findings.causes, module
docstring, 2): the smallest conjunction of predicates over the check, dtype, mesh dims and case parameters."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pandas as pd

from shardcheck.harness.core.records import SIGNATURE_CHECK

MESH = ("dp", "cp", "tp")
ITEM = ["case_id", "dp", "cp", "tp", "dtype"]
MAX_CONJUNCTION = 3  # predicates tried together when searching for an exact condition
Predicate = tuple[str, float, Callable[[dict], bool]]  # (words, order: lower is preferred, test on a row)


def _predicates(rows: list[dict], by_check: bool = True) -> list[Predicate]:
    """Candidate conditions from the values these rows take: check, dtype, mesh dims, case parameters."""
    out: list[Predicate] = []
    checks = sorted({str(r["check"]) for r in rows}) if by_check else []
    for check in checks:
        out.append((f"in {check}", 0, lambda r, c=check: r["check"] == c))
    if any(c.startswith("grad:") for c in checks):
        out.append(("in the gradients", 0, lambda r: str(r["check"]).startswith("grad:")))
    if any(c.startswith("forward") for c in checks):
        out.append(("in the outputs", 0, lambda r: str(r["check"]).startswith("forward")))
    if any(c.startswith("property:") for c in checks):
        out.append(("in values and gradients", 0, lambda r: not str(r["check"]).startswith("property:")))
    for dtype in sorted({r["dtype"] for r in rows}):
        out.append((f"in {dtype}", 1, lambda r, d=dtype: r["dtype"] == d))
    for dim in MESH:
        for v in sorted({r[dim] for r in rows}):
            if v > 1:
                out.append((f"at {dim} ≥ {v}", 2, lambda r, d=dim, v=v: r[d] >= v))
        out.append((f"at {dim} = 1", 2, lambda r, d=dim: r[d] == 1))
    params = [r["params"] if isinstance(r["params"], dict) else {} for r in rows]
    for key in sorted({k for p in params for k in p}):
        values = {p[key] for p in params if key in p and isinstance(p[key], (bool, int, float, str))}
        numbers = sorted(v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool))
        get = lambda r, k=key: r["params"].get(k) if isinstance(r["params"], dict) else None  # noqa: E731
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


def _records(df: pd.DataFrame) -> list[dict]:
    return df[["check", "dtype", "params", *MESH]].to_dict("records")


def separating_condition(bad: pd.DataFrame, passing: pd.DataFrame, by_check: bool = True) -> str:
    """Words for the condition under which `bad` rows occur and `passing` rows do not (module docstring, 2).  Only a
    condition that separates is printed: one that holds on no passing row, or else on no passing row of an item
    the symptom does not fail in (the other checks of its own items pass beside it); otherwise none is."""
    words, exact = _condition(bad, passing, by_check)
    if exact:
        return words
    key = [c for c in ("op", *ITEM) if c in bad and c in passing]
    failing = set(map(tuple, bad[key].astype(str).values))
    others = passing[~passing[key].astype(str).apply(tuple, axis=1).isin(failing)] if len(passing) else passing
    if len(others) < len(passing):
        words, exact = _condition(bad, others, by_check)
        if exact:
            return words
    topologies = _topologies(_records(bad))
    return (
        f"no condition on checks, dtypes, mesh dims or case parameters separates it from the {len(passing)} "
        f"passing rows, at {', '.join(topologies)}"
    )


def _topologies(rows: list[dict]) -> list[str]:
    """The topologies of `rows`; a signature row has none (it is of the module, found before any rank ran)."""
    ran = [r for r in rows if r.get("check") != SIGNATURE_CHECK] or rows
    return sorted({f"dp{r['dp']}-cp{r['cp']}-tp{r['tp']}" for r in ran})


def _condition(bad: pd.DataFrame, passing: pd.DataFrame, by_check: bool) -> tuple[str, bool]:
    """(words, whether they separate `bad` from every row of `passing`): the smallest exact conjunction."""
    bad_rows, passing_rows = _records(bad), _records(passing)
    candidates = []
    for words, order, test in _predicates(bad_rows + passing_rows, by_check):
        if all(test(r) for r in bad_rows):
            # the passing rows it holds on, as a bit set
            candidates.append((words, order, sum(1 << i for i, r in enumerate(passing_rows) if test(r))))
    topologies = _topologies(bad_rows)
    chosen, _ = _exact_conjunction(candidates, len(passing_rows))
    if chosen is None:
        return "", False
    where = (
        []
        if any(p[1] == 2 for p in chosen)
        else ([f"at every topology ({', '.join(topologies)})"] if len(topologies) > 1 else [f"at {topologies[0]}"])
    )
    words = ", ".join([p[0] for p in chosen] + where)
    if not chosen:  # nothing passed, or nothing needed: every row of the op's evidence fails
        return f"always (every case, dtype and check run), {words}", True
    return f"exactly {words}", True


def _exact_conjunction(candidates, n_passing: int):
    """The smallest conjunction (then the most preferred) that excludes every passing row, or (None, n)."""
    if n_passing == 0:
        return [], 0
    for size in range(1, MAX_CONJUNCTION + 1):
        exact = []
        for combo in itertools.combinations(candidates, size):
            held = (1 << n_passing) - 1
            for c in combo:
                held &= c[2]
            if not held:
                exact.append(combo)
        if exact:
            best = min(exact, key=lambda combo: (sum(c[1] for c in combo), [c[1] for c in combo]))
            return sorted(best, key=lambda c: c[1]), 0
        if len(candidates) > 40 and size == 2:  # many parameters: pairs are as far as is cheap
            break
    return None, n_passing
