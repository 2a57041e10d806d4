"""What the zoo's entries that need a missing capability share: their cases, none until the capability lands.

Each such entry writes its bug's metadata and the broken and fixed functions (the arithmetic the thread changed);
`pending(bug)` is its `cases()`: no case while `bug.needs` names a capability the harness lacks, so `shardcheck zoo`
counts it missed and says why.  When the capability merges, the entry's pair is written as a ModelCase using it and
`needs` is dropped."""

from __future__ import annotations

from shardcheck.harness.core.zoo_bug import Bug


def pending(bug: Bug) -> list:
    assert bug.needs is not None, f"{bug.thread}: an entry whose bug needs nothing builds its pair (_twins.twins)"
    return []
