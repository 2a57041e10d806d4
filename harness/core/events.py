"""What the ranks tell the driver: one event log per rank, read back by shardcheck.harness.driver.collect.

Each rank appends JSON lines to DIR/rank<R>.jsonl (DIR: a launch's plan<k>/), one per event, flushed at once (a
crash loses nothing): `start` (an item begins), `phase` (setup, forward, backward), `check` (one check's
result on this rank), `stuck` (a peer did not arrive at the item's barrier: `missing` ranks),
`done` (the item is over here).  For an item that failed somewhere, every rank saves the
tensors it compared to DIR/pieces/item<id>/rank<R>.pt (shardcheck.harness.rank.artefacts reassembles them)."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import ClassVar

from shardcheck.harness.core.records import Phase, Status

PIECES = "pieces"  # per launch: pieces/item<id>/rank<R>.pt, written by the workers for failing items

# A worker's exit code when it ends because a peer is stuck or dead: a consequence, never counted as that
# rank's death (shardcheck.harness.driver.pool.Launch.deaths).
EXIT_PEER_STUCK = 3
# A rank whose driver died (killed outright, no teardown): nobody reads its results, so it ends at once
EXIT_DRIVER_GONE = 4

STOP = "stop"  # a plan file holding only this ends a launch: its ranks exit 0 (shardcheck.harness.rank.worker.serve)


class EventKind(StrEnum):
    """The `t` of an event line."""

    START = "start"  # an item begins on this rank
    PHASE = "phase"  # the rank enters a phase of the item (Phase)
    CHECK = "check"  # one check's result on this rank
    STUCK = "stuck"  # peers did not arrive at the item's barrier in time
    DONE = "done"  # the item is over on this rank


@dataclass(frozen=True)
class Event:
    """One line of a rank's event log: {"t": kind, "item", "rank", "time", **the kind's own fields}."""

    item: int
    rank: int
    time: float

    kind: ClassVar[EventKind]

    def fields(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _COMMON}

    def to_json(self) -> str:
        return json.dumps({"t": self.kind, "item": self.item, "rank": self.rank, "time": self.time, **self.fields()})

    @staticmethod
    def from_json(line: str) -> Event:
        raw = json.loads(line)
        cls = _KINDS[raw.pop("t")]
        names = _FIELD_NAMES[cls]  # (the driver reads every event of a run: dataclasses.fields() each time cost)
        known = {k: v for k, v in raw.items() if k in names}
        if cls is Checked:
            known["result"] = {k: v for k, v in raw.items() if k not in names}
        return cls(**known)


@dataclass(frozen=True)
class Started(Event):
    kind = EventKind.START


@dataclass(frozen=True)
class PhaseEntered(Event):
    phase: Phase
    kind = EventKind.PHASE

    def __post_init__(self):
        object.__setattr__(self, "phase", Phase(self.phase))


@dataclass(frozen=True)
class Checked(Event):
    """One check's result on this rank: `result` holds what shardcheck.harness.core.compare.merge_ranks reads
    (message, errors, budget ratio, mismatch, cause fields...)."""

    check: str
    status: Status
    coords: dict | None = None
    result: dict = dataclasses.field(default_factory=dict)
    kind = EventKind.CHECK

    def __post_init__(self):
        object.__setattr__(self, "status", Status(self.status))

    def fields(self) -> dict:
        return {"check": self.check, "status": self.status, "coords": self.coords, **self.result}

    def as_rank_result(self) -> dict:
        """The per-rank dict the merge reads: the event's own fields, with its rank."""
        return {"rank": self.rank, "item": self.item, "time": self.time, **self.fields()}


@dataclass(frozen=True)
class Stuck(Event):
    missing: list[int]
    waited: float
    kind = EventKind.STUCK


@dataclass(frozen=True)
class Done(Event):
    seconds: float = 0.0
    shim_calls: dict[str, int] | None = None  # the calls this rank's CPU shims handled in the item
    kind = EventKind.DONE


_COMMON = {"item", "rank", "time"}
_KINDS = {cls.kind: cls for cls in (Started, PhaseEntered, Checked, Stuck, Done)}
_FIELD_NAMES = {cls: frozenset(f.name for f in dataclasses.fields(cls)) for cls in _KINDS.values()}


def events_path(events_dir: Path, rank: int) -> Path:
    return events_dir / f"rank{rank}.jsonl"


def stack_path(launch_dir: Path, rank: int) -> Path:
    """Where a rank's Python stacks go when the driver sends it SIGUSR1 (appended: one dump after another)."""
    return launch_dir / f"rank{rank}.stacks"


class Events:
    """This rank's event log: one JSON object per line, flushed at once (a crash loses nothing)."""

    def __init__(self, path: Path, rank: int):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a", buffering=1)
        self.rank = rank

    def started(self, item: int) -> None:
        self._write(Started(item, self.rank, time.time()))

    def phase(self, item: int, phase: Phase) -> None:
        self._write(PhaseEntered(item, self.rank, time.time(), Phase(phase)))

    def checked(self, item: int, check: str, status: Status, coords: dict | None, **result) -> None:
        self._write(Checked(item, self.rank, time.time(), check, Status(status), coords, result))

    def stuck(self, item: int, missing: list[int], waited: float) -> None:
        self._write(Stuck(item, self.rank, time.time(), missing, waited))

    def done(self, item: int, seconds: float, shim_calls: dict[str, int] | None = None) -> None:
        self._write(Done(item, self.rank, time.time(), seconds, shim_calls))

    def _write(self, event: Event) -> None:
        self.file.write(event.to_json() + "\n")
