"""When every wrong tensor of a failing model step is off by one common factor: "every wrong tensor ×2 = dp".

A gradient divided by the wrong count (an HSDP divide factor, a loss not averaged, clipping by a local norm) is one
scale on every tensor it reaches.  A row carries, of its tensor, the largest relative error and the worst element
(expected, got): a tensor that is `f` times the golden has got/expected = f at its worst element and a largest
relative error of |f - 1| over every element; a tensor wrong any other way has a largest relative error beyond what
its worst element's ratio gives.  Where every wrong gradient, activation or loss of an item (a step's stepped
parameters excepted: a wrong gradient's step is no scale of the right one) is the same f, the finding says so, and
which mesh size f is."""

from __future__ import annotations

import math

from shardcheck.harness.core.model_case import step_order
from shardcheck.harness.core.topology import topology_label

SCALED_BY_MESH = "wrong values, a mesh size times the right ones"  # a line's kind (wording.group_kind)
SCALED_BY_PARAMETER = "wrong values, {} times the right ones"  # a case parameter's power: '1/temperature²'

# How closely a tensor's elements must share one scale, per dtype: its rounding, twice over.
_TOLERANCE = {"float64": 1e-9, "float32": 1e-5, "bfloat16": 2e-2}
_ITEM = ("case_id", "dp", "cp", "tp", "dtype", "ep", "dp_replicate")  # dp4 and dp4-ep2 are two items


def _scale(row: dict, whole_tensor: bool = True) -> float | None:
    """f where the row's tensor is f times its golden (f != 1), else None; without `whole_tensor`, f where its worst
    element is."""
    mismatch = row.get("mismatch") if isinstance(row.get("mismatch"), dict) else None
    if mismatch is None or row.get("symptom") != "values":
        return None
    expected, got = mismatch.get("expected"), mismatch.get("got")
    if not isinstance(expected, float) or not isinstance(got, float) or expected == 0:
        return None
    f = got / expected
    tol = _TOLERANCE.get(str(row.get("dtype")), 1e-5)
    rel = row.get("max_rel_err")
    if f <= 0 or abs(f - 1) <= tol:
        return None
    if whole_tensor and (not isinstance(rel, float) or abs(rel - abs(f - 1)) > tol * max(1.0, f)):
        return None
    return f


def _mesh_names(f: float, row: dict, tol: float) -> list[str]:
    """The mesh sizes (or their inverses) of the row's topology that f equals."""
    sizes = {d: int(row[d]) for d in ("dp", "cp", "tp") if int(row[d]) > 1}
    if "dp" in sizes and "cp" in sizes:
        sizes["dp·cp"] = sizes["dp"] * sizes["cp"]
    replicate = row.get("dp_replicate")
    if isinstance(replicate, (int, float)) and replicate == replicate and replicate > 1:  # HSDP (NaN: a plain row)
        sizes.update(dp_replicate=int(replicate), dp_shard=int(row["dp"]) // int(replicate))
    ep = row.get("ep")
    if isinstance(ep, (int, float)) and ep == ep and ep > 1:  # expert parallelism (NaN: a plain row)
        sizes.update(ep=int(ep), edp=int(row["dp"]) // int(ep))
    names = [n for n, s in sizes.items() if abs(f - s) <= tol * s]
    return names or [f"1/{n}" for n, s in sizes.items() if abs(f - 1 / s) <= tol / s]


def _mesh_scale_names(row: dict) -> set[str]:
    """The mesh sizes (or inverses) an op's tensor is times its golden at its worst element, to float32's rounding or
    bfloat16's (an op may compute float64 in float32; its largest relative error may sit on a golden near zero); not a
    model step's tensor: `factor_text` reads those by item."""
    if step_order(str(row.get("check"))) is not None:
        return set()
    f = _scale(row, whole_tensor=False)
    tol = max(_TOLERANCE["float32"], _TOLERANCE.get(str(row.get("dtype")), 0.0))
    return set(_mesh_names(f, row, tol)) if f is not None else set()


def scaled_by_mesh(rows: list[dict], passing: list[dict]) -> list[bool]:
    """For each failing row, whether its values are exactly a mesh size times the right ones, as every other wrong
    value of its op's check is, by one mesh dim, and the check passes somewhere that dim is 1: a gradient reduced
    twice or never, a root of its own apart from other wrong values of the same check and condition (an upstream
    loss's ×TP gradient beside its teacher gradient's error).  Otherwise the factor is no mesh size's (a temperature
    of 0.5 where T² was meant, a mean over 16 tokens of which 8 count: ×2 or ×1/2 at tp 2, and at tp 1 too)."""
    names = [_mesh_scale_names(r) if r.get("symptom") in ("values", "nonfinite") else None for r in rows]
    common: dict[tuple, set[str]] = {}
    for r, n in zip(rows, names):
        if n is not None:
            key = (r.get("op"), r.get("check"))
            common[key] = common[key] & n if key in common else n
    unit: dict[tuple, set[str]] = {}  # the mesh dims of size 1 where the op's check passed
    for r in passing:
        unit.setdefault((r.get("op"), r.get("check")), set()).update(d for d in ("dp", "cp", "tp") if int(r[d]) == 1)
    for key, found in common.items():
        common[key] = {n for n in found if set(n.removeprefix("1/").split("·")) <= unit.get(key, set())}
    return [bool(n) and bool(common[(r.get("op"), r.get("check"))]) for r, n in zip(rows, names)]


def _parameter_names(f: float, row: dict, tol: float) -> set[str]:
    """The powers of the row's numeric case parameters (p, 1/p, p², 1/p²; p > 0, p != 1) that f equals."""
    params = row.get("params") if isinstance(row.get("params"), dict) else {}
    names = set()
    for name, p in params.items():
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not p > 0 or p == 1:
            continue
        for label, v in ((name, p), (f"1/{name}", 1 / p), (f"{name}²", p * p), (f"1/{name}²", 1 / (p * p))):
            if abs(f - v) <= tol * v:
                names.add(label)
    return names


def _parameter_of(label: str) -> str:
    return label.removeprefix("1/").removesuffix("²")


def _parameter_evidence(row: dict) -> set[str] | None:
    """The case parameter powers a failing row's values are times the right ones at its worst element (an empty set: a
    wrong value of no such scale); None where the row holds no tensor to read (a property, a loss judged by a
    message).  An op may compute float64 in float32: float32's rounding at least (as _mesh_scale_names)."""
    if row.get("symptom") == "nonfinite":
        return set()
    mismatch = row.get("mismatch") if isinstance(row.get("mismatch"), dict) else {}
    if row.get("symptom") != "values" or not all(isinstance(mismatch.get(k), float) for k in ("expected", "got")):
        return None
    f = _scale(row, whole_tensor=False)
    tol = max(_TOLERANCE["float32"], _TOLERANCE.get(str(row.get("dtype")), 0.0))
    return _parameter_names(f, row, tol) if f is not None else set()


def _item_of(row: dict) -> tuple:
    return (row.get("op"), *(str(row.get(k)) for k in _ITEM))


def scaled_by_parameter(rows: list[dict], passing: list[dict]) -> list[str | None]:
    """For each failing row, the power of a case parameter its values are exactly times the right ones
    ('1/temperature²'), as every other wrong value of its op's check is, where the check passes in an item of that
    parameter at 1: a scale the op applies wrongly or not at all (a distillation loss without its T² factor), a root
    of its own beside other wrong values of the same check.  A failing row with no tensor to read (property:dp_sum)
    in an item so scaled is of that root too.  None for the others."""
    names = [_parameter_evidence(r) for r in rows]
    common: dict[tuple, set[str]] = {}
    for r, n in zip(rows, names):
        if n is not None:
            key = (r.get("op"), r.get("check"))
            common[key] = common[key] & n if key in common else n
    unit: dict[tuple, set[str]] = {}  # the parameters at 1 in an item where the op's check passed
    for r in passing:
        params = r.get("params") if isinstance(r.get("params"), dict) else {}
        at_one = {k for k, v in params.items() if not isinstance(v, bool) and isinstance(v, (int, float)) and v == 1}
        unit.setdefault((r.get("op"), r.get("check")), set()).update(at_one)
    out = []
    for r, n in zip(rows, names):
        key = (r.get("op"), r.get("check"))
        found = {x for x in common.get(key, set()) if _parameter_of(x) in unit.get(key, set())}
        out.append(SCALED_BY_PARAMETER.format(sorted(found)[0]) if n and found else None)
    by_item = {_item_of(r): kind for r, kind in zip(rows, out) if kind}
    return [
        kind or (by_item.get(_item_of(r)) if n is None and r.get("status") == "fail" else None)
        for r, n, kind in zip(rows, names, out)
    ]


def scale_kinds(rows: list[dict], passing: list[dict]) -> list[str | None]:
    """For each failing row, its kind when its values are exactly a mesh size (SCALED_BY_MESH) or a case parameter's
    power (SCALED_BY_PARAMETER) times the right ones, else None."""
    by_parameter = scaled_by_parameter(rows, passing)
    return [SCALED_BY_MESH if on else kind for on, kind in zip(scaled_by_mesh(rows, passing), by_parameter)]


def is_scaled(kind: str) -> bool:
    """Whether a line's kind is values exactly a mesh size's or a case parameter's power times the right ones."""
    prefix, suffix = SCALED_BY_PARAMETER.split("{}")
    return kind == SCALED_BY_MESH or (kind.startswith(prefix) and kind.endswith(suffix))


def apart_by_scale(symptoms: list[dict]) -> list[list[dict]]:
    """An op's wrong answers as groups to read apart: those exactly a mesh size times the right ones, those exactly one
    power of a case parameter times them (one group each), and the others (a gradient reduced twice, a missing T²: a
    root of its own beside another bug of the same check and condition)."""
    groups: dict[str, list[dict]] = {}
    for s in symptoms:
        groups.setdefault(s["kind"] if is_scaled(s["kind"]) else "", []).append(s)
    return [groups[k] for k in sorted(groups, key=lambda k: (k == "", k))]


def _item_scale(rows: list[dict]) -> float | None:
    """The one f every wrong tensor of an item is off by (two tensors at least), else None."""
    rows = [r for r in rows if not str(r["check"]).startswith("forward:step:")]
    scales = [_scale(r) for r in rows]
    if len(scales) < 2 or any(f is None for f in scales):
        return None
    tol = _TOLERANCE.get(str(rows[0].get("dtype")), 1e-5)
    return scales[0] if all(abs(f - scales[0]) <= tol * scales[0] for f in scales) else None


def factor_text(rows: list[dict]) -> str:
    """'every wrong tensor ×2 = dp' (one factor), 'every wrong tensor ×dp (×2 at dp2-cp1-tp1, ×4 at dp4-cp1-tp1)'
    (one mesh size, items of several sizes), 'every wrong tensor of a step off by one factor: ×32 at dp1-cp1-tp1,
    ×16 at dp2-cp1-tp1' (a factor per item, no one mesh size), or "" where some item's wrong tensors share none."""
    rows = [r for r in rows if step_order(str(r["check"])) is not None]
    items: dict[tuple, list[dict]] = {}
    for r in rows:
        items.setdefault(tuple(r.get(k) for k in _ITEM), []).append(r)
    found = []
    for _, item_rows in sorted(items.items(), key=lambda kv: tuple(int(n) for n in kv[0][1:4])):  # by mesh sizes
        f = _item_scale(item_rows)
        if f is None:
            return ""
        row = item_rows[0]
        names = _mesh_names(f, row, _TOLERANCE.get(str(row.get("dtype")), 1e-5))
        found.append((f, " = ".join(names), topology_label(row)))
    if not found:
        return ""
    values = {float(f"{f:.4g}") for f, _, _ in found}
    names = {name for _, name, _ in found}
    if len(values) == 1:
        name = names.pop() if len(names) == 1 else ""
        return f"every wrong tensor ×{_number(found[0][0])}" + (f" = {name}" if name else "")
    at = ", ".join(dict.fromkeys(f"×{_number(f)} at {topology}" for f, _, topology in found))
    if len(names) == 1 and "" not in names:
        return f"every wrong tensor ×{names.pop()} ({at})"
    return f"every wrong tensor of a step off by one factor: {at}"


def _number(f: float) -> str:
    return f"{f:.4g}" if not math.isclose(f, round(f)) else f"{round(f)}"
