"""A field bug of the zoo (zoo/, `shardcheck zoo`): the thread it comes from and what its pair must show.

Each zoo entry is a suite file holding a pair of cases of one op, `broken` (the plan or op as the project had it) and
`fixed` (its fixed twin), ported onto a small CPU model or op, and a `BUG` that says where it comes from (the thread,
the symptom users saw, how long it took to find, the fix) and what a finding on the broken case must name.  An entry
whose bug needs a capability the harness lacks says which (`needs`): its pair is not run and it counts as missed."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from shardcheck.harness.core.topology import Topology


class Capability(enum.StrEnum):
    """A capability a zoo pair needs that the harness does not have yet (the issue that builds it): the extension point
    for a field bug not expressible yet (docs/zoo.md).  Only the missing ones are members, each with a test that
    tells when it has landed (tests/test_zoo.py); when one lands, its member goes and its entries become pairs.  None
    is missing today: issue 38's averaged DP convention, HSDP, micro-batches and clipping (zoo/pytorch_155903.py,
    verl_7493.py, nemo_12210.py, transformers_34191.py) and issue 39's `ep` axis and MoE family
    (zoo/megatron_lm_1628.py, megatron_lm_5956.py) have landed."""


BROKEN, FIXED = "broken", "fixed"  # the case ids of a pair
BROKEN_DTYPES = ("float64",)  # a wrong answer shows in float64 first; the fixed twin must pass in every dtype
FIXED_DTYPES = ("float64", "float32", "bfloat16")


@dataclass(frozen=True, kw_only=True)
class Bug:
    """One field bug.  `names`: what the finding on the broken case must name to be *named right* (the module,
    parameter or check the thread's fix touched): any of them, as it appears in the finding's line.  `shows`: for an
    op whose failing checks alone say little (its one output, `forward`), what the worst line of a check must show
    as well, {check: a regular expression searched in it}: the rank, the element, the error the fix removed."""

    thread: str  # "NVIDIA/Megatron-LM#673"
    url: str
    title: str  # what was wrong, one line
    symptom: str  # what the users saw
    time_to_find: str  # from the thread's dates: report to diagnosis or fix
    fix: str  # the fixing commit or pull request ("open" when none has landed)
    topology: str  # where the pair runs: "dp=1,cp=2,tp=1"
    names: tuple[str, ...]
    shows: dict[str, str] = field(default_factory=dict)
    related: tuple[str, ...] = ()  # other threads of the same bug
    needs: Capability | None = None

    def __post_init__(self):
        Topology.parse(self.topology)  # a malformed topology is the entry's error, when it loads
        if not self.names:
            raise ValueError(f"zoo bug {self.thread}: `names` must say what its finding has to name")

    @property
    def where(self) -> Topology:
        return Topology.parse(self.topology)

    def runs_on(self, topology: Topology) -> bool:
        """The pair runs at its own topology only (one run shares the launches of every pair)."""
        return topology == self.where
