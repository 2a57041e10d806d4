"""The suites (`suites/<name>.py`, one or more per family) and their cases."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

import suites
from harness.case import Case
from harness.topology import UsageError

BENCH_FALLBACK_CASES = 2  # per op without benchmark cases


def suite_names() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(suites.__path__) if not m.name.startswith("_"))


def load_suite(name: str) -> ModuleType:
    if name not in suite_names():
        raise UsageError(f"unknown suite {name!r}; known: {', '.join(suite_names())}")
    return importlib.import_module(f"suites.{name}")


def suite_cases(name: str, quick: bool, bench: bool = False) -> list[Case]:
    """The suite's correctness cases, or its benchmark cases: `bench_cases()` (realistic sizes),
    plus, for every op that has none, its first correctness cases, so that every op present
    (and every op added later) is measured without further work."""
    suite = load_suite(name)
    cases = suite.cases(quick=quick)
    if bench:
        sized = suite.bench_cases(quick=quick) if hasattr(suite, "bench_cases") else []
        covered = {c.op for c in sized}
        fallback = [c for c in cases if c.op not in covered and c.bad_input is None]
        cases = sized + [c for i, c in enumerate(fallback)
                         if sum(f.op == c.op for f in fallback[:i]) < BENCH_FALLBACK_CASES]
    seen = set()
    for case in cases:
        key = (case.op, case.case_id)
        if key in seen:
            raise UsageError(f"suite {name}: duplicate case id {case.case_id!r} for {case.op}")
        seen.add(key)
    return cases
