"""What every zoo entry shares: its pair of cases, `broken` and `fixed`, built by one function of the variant.

`twins(bug, make)` calls `make(variant, where)` for each of the two and returns the cases; `where` holds the
fields that place a case (its dtypes: float64 for the broken one, all three for the fixed twin; the topology of
its bug alone), to be passed on to the `Case` or `ModelCase`.  `variant(ctx)` reads the variant back on a rank."""

from __future__ import annotations

from collections.abc import Callable

from shardcheck.harness.core.zoo_bug import BROKEN, BROKEN_DTYPES, FIXED, FIXED_DTYPES, Bug


def twins(bug: Bug, make: Callable[[str, dict], object]) -> list:
    """The pair of cases of `bug` (none where it needs a capability the harness lacks: `bug.needs`)."""
    if bug.needs is not None:
        return []
    pair = []
    for name, dtypes in ((BROKEN, BROKEN_DTYPES), (FIXED, FIXED_DTYPES)):
        pair.append(make(name, {"dtypes": dtypes, "supports": bug.runs_on, "params": {"variant": name}}))
    return pair


def variant(ctx) -> str:
    """The variant (`broken` or `fixed`) of the case a rank runs."""
    return ctx.params["variant"]
