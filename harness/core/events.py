"""What the ranks tell the driver: one event log per rank, read back by shardcheck.harness.driver.collect.

Each rank appends JSON lines to DIR/rank<R>.jsonl (DIR: a launch's plan<k>/), one per event, flushed at once (a crash loses
nothing): `start` (an item begins), `phase` (setup, forward, backward), `check` (one check's
result on this rank), `stuck` (a peer did not arrive at the item's barrier: `missing` ranks),
`done` (the item is over here).  For an item that failed somewhere, every rank saves the
tensors it compared to DIR/pieces/item<id>/rank<R>.pt (shardcheck.harness.rank.artefacts reassembles them)."""

from __future__ import annotations

import json
import time
from pathlib import Path

PIECES = "pieces"  # per launch: pieces/item<id>/rank<R>.pt, written by the workers for failing items

# A worker's exit code when it ends because a peer is stuck or dead: a consequence, never counted as that
# rank's death (shardcheck.harness.driver.pool.Launch.deaths).
EXIT_PEER_STUCK = 3

STOP = "stop"  # a plan file holding only this ends a launch: its ranks exit 0 (shardcheck.harness.rank.worker.serve)


def events_path(events_dir: Path, rank: int) -> Path:
    return events_dir / f"rank{rank}.jsonl"


class Events:
    """This rank's event log: one JSON object per line, flushed at once (a crash loses nothing)."""

    def __init__(self, path: Path, rank: int):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a", buffering=1)
        self.rank = rank

    def emit(self, kind: str, item: int, **fields) -> None:
        self.file.write(json.dumps({"t": kind, "item": item, "rank": self.rank, "time": time.time(), **fields}) + "\n")
