"""The one cause of an item the driver ends (Collector.abort): a rank that died; else a rank that raised no later
than where its peers then blocked (they blocked because of it); else the ranks that did not finish (a hang).  The
cause is recorded on each of the item's error rows (ResultRow's cause fields); the notes say it for people."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shardcheck.harness.core.records import PHASES, Phase, Symptom
from shardcheck.harness.rank.worker import RAISED_GRACE

if TYPE_CHECKING:
    from shardcheck.harness.driver.postmortem import Postmortem


@dataclass(frozen=True)
class Root:
    """An item's cause, as ResultRow's cause fields (records.NO_CAUSE, in its order)."""

    symptom: str
    culprit_ranks: list[int]
    blocked_ranks: list[int] = field(default_factory=list)
    error_type: str | None = None
    error_message: str | None = None
    error_where: str | None = None
    phase: str | None = None

    @classmethod
    def raised(cls, raised: dict, blocked: list[int]) -> Root:
        """The exception a rank raised on its own (Collector._first_exception), the `blocked` ranks after it."""
        return cls(
            raised.get("symptom") or Symptom.EXCEPTION,
            raised["culprit_ranks"],
            blocked,
            raised.get("error_type"),
            raised.get("error_message"),
            raised.get("error_where"),
            raised.get("phase"),
        )

    def fields(self) -> dict:
        return dataclasses.asdict(self)


def phase_order(phase: str | None) -> int:
    """Where `phase` comes in a case (PHASES); an unknown phase (a benchmark's) counts as the forward."""
    return PHASES.index(phase) if phase in PHASES else PHASES.index(Phase.FORWARD)


@dataclass(frozen=True)
class Ending:
    """What the driver knows of an item when it ends it."""

    participants: list[int]
    deaths: dict[int, str]  # rank -> how its process died by itself ('SIGKILL', 'exit code 13')
    last_words: dict[int, str]  # rank -> its last error lines (the postmortem's)
    stuck_ranks: list[int]  # the ranks a barrier found missing, the dead left out
    raised: dict | None  # the first exception a rank raised on its own (Collector._first_exception)
    phase: dict[int, str]  # rank -> the phase it was last in
    evidence: Postmortem | None  # the ranks' stacks and collectives (harness/driver/postmortem.py)

    def phase_of(self, rank: int) -> str:
        return self.phase.get(rank, Phase.SETUP)


def choose_root(end: Ending, done: dict[int, float]) -> Root:
    """The item's cause (module docstring); `done`: the ranks that finished it."""
    if end.deaths:
        deaths, words = end.deaths, end.last_words
        message = "; ".join(
            f"rank {r}: {w}" if len(deaths) > 1 else w for r, w in sorted(words.items()) if r in deaths and w
        )
        return Root(
            Symptom.DIED,
            sorted(deaths),
            [r for r in end.participants if r not in deaths],
            ", ".join(dict.fromkeys(how for _, how in sorted(deaths.items()))),
            message or None,
            None,
            end.phase_of(min(deaths)),
        )
    blocked_at = min((phase_order(end.phase_of(r)) for r in end.stuck_ranks), default=len(PHASES))
    raised = end.raised
    if raised is not None and phase_order(raised.get("phase")) <= blocked_at:
        return Root.raised(raised, [r for r in end.stuck_ranks if r not in raised["culprit_ranks"]])
    culprits = end.stuck_ranks or [r for r in end.participants if r not in done]
    evidence = end.evidence
    if evidence is not None and evidence.culprits:  # the ranks the stacks name: a collective never entered, a loop
        culprits = evidence.culprits
    root = Root(Symptom.HUNG, culprits, phase=end.phase_of(culprits[0]) if culprits else None)
    if evidence is not None and evidence.culprits:
        root = dataclasses.replace(root, blocked_ranks=[r for r in end.participants if r not in culprits])
    if evidence is not None and evidence.text:
        root = dataclasses.replace(root, error_message=evidence.text, error_where=evidence.where)
    return root


def abort_notes(end: Ending, root: Root, timeout: float, reason: str) -> list[str]:
    """The item's cause for people, joined to the message of each of its non-passing rows."""
    deaths, words = end.deaths, end.last_words
    notes = [f"rank {r} died: {how}" + (f": {words[r]}" if words.get(r) else "") for r, how in sorted(deaths.items())]
    waiting = [r for r in end.participants if r not in deaths]
    if deaths and waiting:
        notes.append(
            f"rank(s) {', '.join(map(str, waiting))} waiting on rank(s) {', '.join(map(str, sorted(deaths)))} ("
            + ", ".join(f"rank {r} in {end.phase.get(r, 'setup')}" for r in waiting)
            + ")"
        )
    if end.stuck_ranks:
        notes.append(_stuck_note(end, root, timeout))
    if reason:
        notes.append(reason)
    if end.evidence is not None and end.evidence.text:
        notes.append(end.evidence.text)
    if end.evidence is not None and end.evidence.artefacts:
        notes.append(f"stacks and collectives: {end.evidence.artefacts}")
    return notes


def _stuck_note(end: Ending, root: Root, timeout: float) -> str:
    # The budget, not the measured wait: the barrier's poll and a loaded machine add a tenth or two, and the user
    # set --timeout (the event keeps the measured wait).
    after_raise = root.symptom != Symptom.HUNG and not end.deaths
    why = (
        f"blocked after rank(s) {', '.join(map(str, end.raised['culprit_ranks']))} raised "
        f"{end.raised.get('error_type')}"
        if after_raise
        else "blocked or dead"
    )
    # after a raise, the ranks that got to the item's end wait RAISED_GRACE for the others, not --timeout
    within = f"{min(RAISED_GRACE, timeout):g}s of the raise" if after_raise else f"{timeout:g}s"
    return (
        f"rank(s) {', '.join(map(str, end.stuck_ranks))} did not finish the case within {within} "
        f"({why}; " + ", ".join(f"rank {r} in {end.phase.get(r, 'setup')}" for r in end.stuck_ranks) + ")"
    )


def cause_words(end: Ending, root: Root, reason: str) -> str:
    """The cause in a few words ('hung', 'rank 1 died'), for the items skipped after it."""
    if end.deaths:
        return " and ".join(f"rank {r} died ({how})" for r, how in sorted(end.deaths.items()))
    if root.symptom != Symptom.HUNG:
        return f"hung after rank(s) {', '.join(map(str, root.culprit_ranks))} raised {root.error_type}"
    return "hung" if end.stuck_ranks or reason else "ended its launch"
