"""Where a model case's step first leaves the single-device one.

A model case's checks carry their place in the step (shardcheck.harness.core.model_case): `forward:actNN:<module>`
in forward order, `forward:loss`, `forward:dactNN:<module>` in backward order, then `forward:dparam:<param>` and
`forward:step:<param>` (with `forward:grad_norm` and `forward:state:<param>.<state>` between them, and the checks
of later micro-batches and optimizer steps, `@mb<j>` / `@step<s>`, in their places).  A cause among them is named
by its first failing check in that order; the modules after it are its consequences, and the parameters whose
gradients or stepped values are wrong are listed.
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
    "state": "optimizer state",
    "step": "after the step",
}
_PARAM_KINDS = ("dparam", "state", "step")


def _subject(check: str) -> tuple[str, str]:
    """(kind, module or parameter) of a model check (a state's parameter without the state's name)."""
    m = _CHECK.match(check)
    if m.group(1):
        return m.group(1), m.group(3)
    if m.group(4):
        return m.group(4), m.group(4)
    return m.group(5), m.group(6).rsplit(".", 1)[0] if m.group(5) == "state" else m.group(6)


def _where(check: str) -> str:
    """', step 2, micro-batch 3' where a check is of a later optimizer step or micro-batch, else ''."""
    m = _CHECK.match(check)
    return (f", step {m.group(7)}" if m.group(7) else "") + (f", micro-batch {m.group(8)}" if m.group(8) else "")


def _what(check: str) -> str:
    """The first diverging check in words: 'module wo (output, forward)', 'parameter w (gradient, step 2)'."""
    kind, name = _subject(check)
    where = _where(check)
    if kind in ("loss", "grad_norm"):
        what = "the loss" if kind == "loss" else "the gradients' total norm (clipping)"
        return what + (f" ({where[2:]})" if where else "")
    if kind == "state":
        return f"parameter {name} (optimizer state {_CHECK.match(check).group(6).rsplit('.', 1)[1]}{where})"
    if kind in _PARAM_KINDS:
        return f"parameter {name} ({_WORDS[kind]}{where})"
    return f"module {name} ({_WORDS[kind]}, {'forward' if kind == 'act' else 'backward'}{where})"


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
    kind = _subject(first)[0]
    params = list(dict.fromkeys(_subject(c)[1] for c in model if _subject(c)[0] in _PARAM_KINDS))  # step order
    others = [c for c in checks if step_order(c) is None]
    parts = [f"first diverging: {_what(first)} [{first}]"] + ([factor] if factor else [])
    if len(model) > 1:
        parts.append(f"{len(model) - 1} check(s) after it, its consequences")
    if params and kind in _PARAM_KINDS:
        parts.append("wrong parameters: " + ", ".join(params))
    elif params:  # downstream of a wrong activation every parameter is: a count, not a list
        parts.append(f"{len(params)} parameter(s) wrong after it")
    return "; ".join(parts + sorted(set(others)))
