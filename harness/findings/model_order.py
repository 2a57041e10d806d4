"""Where a model case's step first leaves the single-device one.

A model case's checks carry their place in the step (shardcheck.harness.core.model_case): `forward:actNN:<module>`
in forward order, `forward:loss`, `forward:dactNN:<module>` in backward order, then `forward:dparam:<param>` and
`forward:step:<param>`.  A cause among them is named by its first failing check in that order; the modules after it
are its consequences, and the parameters whose gradients or stepped values are wrong are listed.
"""

from __future__ import annotations

import math

from shardcheck.harness.core.model_case import CHECK as _CHECK
from shardcheck.harness.core.model_case import step_order

_WORDS = {
    "act": "output",
    "loss": "loss",
    "dact": "gradient at its output",
    "dparam": "gradient",
    "step": "after the step",
}


def _subject(check: str) -> tuple[str, str]:
    """(kind, module or parameter) of a model check."""
    m = _CHECK.match(check)
    if m.group(1):
        return m.group(1), m.group(3)
    return ("loss", "loss") if m.group(4) else (m.group(5), m.group(6))


def first_check(checks: list[str]) -> str | None:
    """The first model check in step order; of equals (parameters share their stage's place), the first in `checks`
    (the case's output order).  The one check a finding's "first diverging" and its "worst:" both name."""
    model = [c for c in dict.fromkeys(map(str, checks)) if step_order(c) is not None]
    return min(model, key=step_order) if model else None  # min: the first of equals


def first_row(rows: list[dict], ratio) -> dict | None:
    """The row of the first failing check (first_check: the one `summary` names), the worst of its ranks and items;
    None without model checks."""
    first = first_check([r["check"] for r in rows])
    if first is None:
        return None
    return max((r for r in rows if str(r["check"]) == first), key=lambda r: (math.isfinite(ratio(r)), ratio(r)))


def summary(checks: list[str], factor: str = "") -> str | None:
    """'first diverging: module layers.0.attention.wo (output, forward); 12 checks after it; wrong parameters: ...'
    for a cause's checks, or None without model checks; `factor` (common_factor: 'every wrong tensor ×2 = dp')
    right after the first divergence."""
    first = first_check(checks)  # the check first_row's "worst:" row is of
    if first is None:
        return None
    # (stable: parameters, which share their stage's place, stay in the order of the case's outputs; model[0] is first)
    model = sorted((c for c in dict.fromkeys(map(str, checks)) if step_order(c) is not None), key=step_order)
    kind, name = _subject(first)
    what = (
        "the loss"
        if kind == "loss"
        else f"parameter {name} ({_WORDS[kind]})"
        if kind in ("dparam", "step")
        else f"module {name} ({_WORDS[kind]}, {'forward' if kind == 'act' else 'backward'})"
    )
    params = list(dict.fromkeys(_subject(c)[1] for c in model if _subject(c)[0] in ("dparam", "step")))  # step order
    others = [c for c in checks if step_order(c) is None]
    parts = [f"first diverging: {what} [{first}]"] + ([factor] if factor else [])
    if len(model) > 1:
        parts.append(f"{len(model) - 1} check(s) after it, its consequences")
    if params and kind in ("dparam", "step"):
        parts.append("wrong parameters: " + ", ".join(params))
    elif params:  # downstream of a wrong activation every parameter is: a count, not a list
        parts.append(f"{len(params)} parameter(s) wrong after it")
    return "; ".join(parts + sorted(set(others)))
