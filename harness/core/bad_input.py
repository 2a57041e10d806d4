"""`BadInput`: a case that feeds the op input outside its contract, judged "loud or right"."""

from __future__ import annotations

from dataclasses import dataclass

from shardcheck.harness.core.citations import Rule
from shardcheck.harness.core.records import Status

BAD_INPUT_CHECK = "property:bad_input"


@dataclass(frozen=True)
class BadInput:
    """A case that feeds the op input outside its contract, judged "loud or right".

    The op passes when it raises (any exception: its type is recorded), or, where the case names a
    documented `interpretation` of the input, when it returns the answer of that interpretation: the
    case's reference computes it, and outputs and gradients are compared as in any case (the
    `forward` / `grad:` rows then stand for the case).  It fails on a silent return where no
    interpretation exists, on a wrong answer, a hang or a dead rank.  `documented`: the exception
    types the seed documents for this input; raising another type is then a `warn`."""

    what: str  # the input outside the contract, in words
    interpretation: str | None = None  # the documented reading a returned answer is judged by
    documented: tuple[type[BaseException], ...] = ()
    # Whose rule says this input is outside the contract: the seed's (it states the shapes, or documents the error) or
    # ours ("loud or right" where the seed does not say what the op does with it).
    rule: Rule | None = None

    def judge_raise(self, exc: BaseException) -> tuple[str, str]:
        """(status, message) of the op raising `exc` on this input."""
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        raised = f"raised {type(exc).__name__}" + (f": {first}" if first else "")
        if self.documented and not isinstance(exc, self.documented):
            names = " or ".join(t.__name__ for t in self.documented)
            return Status.WARN, f"{raised}; the seed documents {names} for {self.what}"
        return Status.PASS, raised

    def silent_return(self) -> str:
        """The message of a silent return where no interpretation exists."""
        return (
            f"returned without an exception on {self.what}, for which no answer is documented: "
            "the op must raise instead of returning silently"
        )
