"""Where a check's rule comes from: `Rule(RuleSource.SEED | RuleSource.OURS, cite)`, made with `seed(...)` or
`ours(...)`, and the rules of the harness's own checks.  How a rule changes a verdict is shardcheck.harness.core.rules.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from shardcheck.harness.core.topology import Topology


class RuleSource(enum.StrEnum):
    """Where a check's rule comes from: the seed's API docs, or a choice of ours that docs/ops states."""

    SEED = "seed"  # the seed says so: a quoted sentence, or its signature
    OURS = "ours"  # the seed leaves it open; docs/ops/<family>.md#<section> fixes it


@dataclass(frozen=True)
class Rule:
    """Where the rule a check enforces comes from (`source`) and where it is written (`cite`): for the seed a quoted
    sentence or the signature, for ours the docs/ops section ("docs/ops/model_utils.md#log-probs-of-a-target").  Under
    `--impl`, a failure of a rule that is ours alone is a `warn` naming it, unless it is a silent wrong answer."""

    source: RuleSource
    cite: str

    def __post_init__(self):
        object.__setattr__(self, "source", RuleSource(self.source))
        if not self.cite.strip():
            raise ValueError("a Rule cites where it is written (a seed sentence or a docs/ops section)")
        if self.source == RuleSource.OURS and "#" not in self.cite:  # a suite of someone else's cites its own docs
            raise ValueError(
                f"a rule of ours cites the section that states it (docs/ops/<family>.md#<anchor>), got {self.cite!r}"
            )

    def __str__(self) -> str:
        return f"rule: ours, {self.cite}" if self.source == RuleSource.OURS else f"rule: seed: {self.cite}"


@dataclass(frozen=True)
class OutsideSeed:
    """Input of a case that the seed does not describe, everywhere or at some topologies only (`at`): there every
    check of the case but the harness's own (the communication contract, the signature, a bad input's own rule) is
    judged under `rule`, a rule of ours.  The input decides, not the check: ids outside [0, V) everywhere; V = 37
    split over TP 2 where the op's seed states its shard as `vocab_size//TP` (at TP 1 it is the seed's own shape)."""

    what: str  # the input, in words ("targets outside [0, V)", "V not divisible by TP")
    rule: Rule
    at: Callable[[Topology], bool] | None = None  # the topologies where the input is outside the seed (None: all)

    def __post_init__(self):
        if self.rule.source != RuleSource.OURS:
            raise ValueError(f"input outside the seed ({self.what}) is judged under a rule of ours, got {self.rule}")

    def holds_at(self, topology: Topology | None) -> bool:
        """Whether the input is outside the seed at `topology` (None: at every topology, whatever it is)."""
        if self.at is None:
            return True
        return topology is not None and bool(self.at(topology))


def seed(cite: str) -> Rule:
    """A rule the seed states: `cite` quotes its sentence or names its signature."""
    return Rule(RuleSource.SEED, cite)


def ours(cite: str) -> Rule:
    """A rule of ours: `cite` is its docs/ops section, docs/ops/<family>.md#<anchor>."""
    return Rule(RuleSource.OURS, cite)


# The standard value and gradient checks: the op's documented result, on the inputs the seed describes.
DOCUMENTED_RESULT = seed("the op's documented result (its docstring and signature)")
# The harness's own checks.
COMM_RULE = ours("docs/ops/README.md#conventions-shared-by-every-family")  # the communication contract
SIGNATURE_RULE = seed("the seed's signature")
# float64 computed in float32, bfloat16 math: the precision each dtype computes in is ours to fix
PRECISION_RULE = ours("docs/ops/README.md#conventions-shared-by-every-family")
