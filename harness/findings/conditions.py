"""The condition that separates a symptom's rows from the passing rows (shardcheck.harness.findings.causes, module
docstring, 2): the smallest conjunction of predicates over the check, dtype, mesh dims and case parameters."""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable

import numpy as np
import pandas as pd

from shardcheck.harness.core.records import SIGNATURE_CHECK
from shardcheck.harness.core.topology import topology_label

MESH = ("dp", "ep", "cp", "tp")  # ep: expert parallelism (rows without it: 1)
ITEM = ["case_id", "dp", "dp_replicate", "ep", "cp", "tp", "dtype"]
PRODUCTS = {"dp·cp": ("dp", "cp")}  # mesh-dim products a trigger may need (each DP·CP rank holds its own batch piece)
FIELDS = ("check", "dtype", *MESH, *PRODUCTS, "params")  # what a predicate reads of a row
MAX_CONJUNCTION = 3  # predicates tried together when searching for an exact condition
# (words, order: lower is preferred, the field it reads, test on that field's value); a test reads one field, so it
# is tried once per distinct value, not once per row (a model case has thousands of rows and few distinct values)
Predicate = tuple[str, float, str, Callable[[object], bool]]


def _predicates(values: dict[str, list], by_check: bool = True) -> list[Predicate]:
    """Candidate conditions from the values the rows take (`_distinct`'s, per field): check, dtype, mesh dims, case
    parameters."""
    out: list[Predicate] = []
    checks = sorted(set(values["check"])) if by_check else []
    for check in checks:
        out.append((f"in {check}", 0, "check", lambda c, want=check: c == want))
    if any(c.startswith("grad:") for c in checks):
        out.append(("in the gradients", 0, "check", lambda c: c.startswith("grad:")))
    if any(c.startswith("forward") for c in checks):
        out.append(("in the outputs", 0, "check", lambda c: c.startswith("forward")))
    if any(c.startswith("property:") for c in checks):
        out.append(("in values and gradients", 0, "check", lambda c: not c.startswith("property:")))
    for dtype in sorted(set(values["dtype"])):
        out.append((f"in {dtype}", 1, "dtype", lambda d, want=dtype: d == want))
    for dim in MESH:
        if dim == "ep" and set(values[dim]) == {1}:  # a run without expert parallelism: no condition on it
            continue
        for v in sorted(set(values[dim])):
            if v > 1:
                out.append((f"at {dim} ≥ {v}", 2, dim, lambda x, v=v: x >= v))
        out.append((f"at {dim} = 1", 2, dim, lambda x: x == 1))
    for product in PRODUCTS:  # after the single dims: said only where no single dim separates as well
        for v in sorted(set(values[product])):
            if v > 1:
                out.append((f"at {product} ≥ {v}", 2.5, product, lambda x, v=v: x >= v))
    params = values["params"]
    for key in sorted({k for p in params for k in p}):
        out += _param_predicates(key, {p[key] for p in params if isinstance(p.get(key), (bool, int, float, str))})
    return out


def _param_predicates(key: str, values: set) -> list[Predicate]:
    """The conditions on one case parameter, from the values it takes (tests on a row's params dict)."""
    out: list[Predicate] = []
    numbers = sorted(v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool))
    order = 4 if len(key) == 1 else 3  # sizes (B, S, V) explain less than named conditions (scale, masked)
    if any(isinstance(v, bool) for v in values):
        out.append((f"with {key}", order, "params", lambda p: p.get(key) is True))
        out.append((f"without {key}", order, "params", lambda p: p.get(key) is not True))
        if any(v is False for v in values):  # set to False, as against not a parameter of the case at all
            out.append((f"with {key} = False", order, "params", lambda p: p.get(key) is False))
    for v in sorted(v for v in values if isinstance(v, str)):
        out.append((f"with {key} = {v}", order, "params", lambda p, v=v: p.get(key) == v))
        out.append((f"with {key} ≠ {v}", order + 0.5, "params", lambda p, v=v: p.get(key) not in (None, v)))
    num = lambda p: p.get(key) if isinstance(p.get(key), (int, float)) and not isinstance(p.get(key), bool) else None  # noqa: E731
    for v in numbers:
        out.append((f"when {key} ≥ {v:g}", order, "params", lambda p, v=v: num(p) is not None and num(p) >= v))
        out.append((f"when {key} ≤ {v:g}", order + 0.5, "params", lambda p, v=v: num(p) is not None and num(p) <= v))
        if v == 0:
            out.append((f"when {key} = 0 or unset", order, "params", lambda p: not num(p)))
    return out


def _distinct(df: pd.DataFrame) -> dict[str, list[tuple[object, int]]]:
    """Per field, each distinct value the rows take and the rows that take it, as a bit set (bit i: row i)."""
    out = {}
    for field in FIELDS:
        if field in PRODUCTS:
            a, b = PRODUCTS[field]
            column = (df[a].astype(int) * df[b].astype(int)).to_numpy(dtype=object).tolist()
        else:
            column = df[field].to_numpy(dtype=object).tolist() if field in df else [1] * len(df)  # (ep: 1 if absent)
        if field == "params":
            values = [p if isinstance(p, dict) else {} for p in column]
            keys = [repr(p) for p in values]  # one case's rows share its params, in one order
        else:
            values = keys = [str(v) for v in column] if field == "check" else column
        where: dict = {}
        for i, k in enumerate(keys):
            where.setdefault(k, (values[i], []))[1].append(i)
        out[field] = [(value, _bits(rows_of, len(keys))) for value, rows_of in where.values()]
    return out


# id of a live frame -> (a weak reference to it, its `_distinct`); an entry leaves with its frame
_PASSING: dict[int, tuple[weakref.ref, dict]] = {}


def _distinct_of_passing(passing: pd.DataFrame) -> dict[str, list[tuple[object, int]]]:
    """`_distinct(passing)`, computed once per frame while it lives: every symptom of an op is separated from the same
    passing rows (thousands of them in a model case), and frames are not changed in place here."""
    key = id(passing)
    kept = _PASSING.get(key)
    if kept is None or kept[0]() is not passing:
        kept = _PASSING[key] = (weakref.ref(passing, lambda _, key=key: _PASSING.pop(key, None)), _distinct(passing))
    return kept[1]


def _item_keys(df: pd.DataFrame, key: list[str]) -> list[tuple]:
    return list(zip(*(df[c].to_numpy(dtype=object).astype(str) for c in key)))


def _topologies(df: pd.DataFrame) -> list[str]:
    """The topologies of `df`'s rows; a signature row has none (it is of the module, found before any rank ran)."""
    ran = df[df["check"] != SIGNATURE_CHECK] if "check" in df else df
    ran = ran if len(ran) else df
    dims = [c for c in ITEM[1:-1] if c in ran]  # the mesh dims topology_label reads
    return sorted({topology_label(dict(zip(dims, mesh))) for mesh in set(zip(*(ran[c].tolist() for c in dims)))})


def _bits(indices: list[int], n: int) -> int:
    mask = np.zeros(n, dtype=bool)
    mask[indices] = True
    return int.from_bytes(np.packbits(mask, bitorder="little").tobytes(), "little")


def separating_condition(bad: pd.DataFrame, passing: pd.DataFrame, by_check: bool = True) -> str:
    """Words for the condition under which `bad` rows occur and `passing` rows do not (module docstring, 2).  Only a
    condition that separates is printed: one that holds on no passing row, or else on no passing row of an item
    the symptom does not fail in (the other checks of its own items pass beside it); otherwise none is."""
    words, exact = _condition(bad, passing, by_check)
    if exact:
        return words
    key = [c for c in ("op", *ITEM) if c in bad and c in passing]
    failing = set(_item_keys(bad, key))
    others = passing[[k not in failing for k in _item_keys(passing, key)]] if len(passing) else passing
    if len(others) < len(passing):
        words, exact = _condition(bad, others, by_check)
        if exact:
            return words
    topologies = _topologies(bad)
    return (
        f"no condition on checks, dtypes, mesh dims or case parameters separates it from the {len(passing)} "
        f"passing rows, at {', '.join(topologies)}"
    )


def _condition(bad: pd.DataFrame, passing: pd.DataFrame, by_check: bool) -> tuple[str, bool]:
    """(words, whether they separate `bad` from every row of `passing`): the smallest exact conjunction."""
    bad_values, passing_values = _distinct(bad), _distinct_of_passing(passing)
    values = {f: [v for v, _ in bad_values[f]] + [v for v, _ in passing_values[f]] for f in FIELDS}
    candidates = []
    for words, order, field, test in _predicates(values, by_check):
        if all(test(value) for value, _ in bad_values[field]):
            held = 0  # the passing rows it holds on, as a bit set
            for value, rows in passing_values[field]:
                if test(value):
                    held |= rows
            candidates.append((words, order, held))
    topologies = _topologies(bad)
    chosen, _ = _exact_conjunction(candidates, len(passing))
    if chosen is None:
        return "", False
    where = (
        []
        if any(p[1] in (2, 2.5) for p in chosen)  # a mesh condition says where
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
