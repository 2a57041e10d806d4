"""`KnownFailure`: a defect of the code under test that is known and tracked elsewhere (`Case.xfail`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shardcheck.harness.core.topology import Topology


@dataclass(frozen=True)
class KnownFailure:
    """A defect of the code under test that is known and tracked elsewhere (`reference`: an upstream issue).

    Per item, the checks it covers (`checks`: fnmatch patterns over check names, "grad:*", "forward") that fail
    or error on some rank are recorded `xfail`, the finding kept in the row's message, and the covered checks
    passing beside them stay `pass` (the defect is still there); once every covered check of the item passes on
    every rank they are `xpass`, which fails the run so that the fix is noticed and the mark removed.
    `when(topology, dtype_name)` limits it to part of the matrix (None: everywhere); a range of a case's
    parameters is marked by setting it only on the cases whose parameters are in the range."""

    reason: str
    reference: str = ""
    checks: tuple[str, ...] = ("*",)
    when: Callable[[Topology, str], bool] | None = None

    def __post_init__(self):
        if not isinstance(self.reason, str) or not self.reason.strip():
            raise ValueError("KnownFailure needs a reason (what fails, in words)")
        checks = (self.checks,) if isinstance(self.checks, str) else tuple(self.checks)  # "grad:*" alone is one pattern
        if not checks or not all(isinstance(c, str) and c for c in checks):
            raise ValueError(f"KnownFailure checks must be non-empty check-name patterns, got {self.checks!r}")
        object.__setattr__(self, "checks", checks)

    def applies(self, topology: Topology, dtype: str) -> bool:
        """Whether it marks the item of this topology and dtype."""
        return self.when is None or bool(self.when(topology, dtype))
