"""Turn the per-rank event files of one launch into result rows, item by item."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from harness.compare import merge_ranks
from harness.plan import Item, Plan
from harness.records import RecordWriter


class _ItemState:
    def __init__(self):
        self.started: dict[int, float] = {}
        self.done: set[int] = set()
        self.phase: dict[int, str] = {}
        self.checks: dict[str, list[dict]] = defaultdict(list)
        self.stuck: list[dict] = []


class Collector:
    """Follows DIR/rank*.jsonl of one launch; writes a row per check when an item is complete."""

    def __init__(self, plan: Plan, items: list[Item], events_dir: Path, writer: RecordWriter, world_size: int):
        self.plan, self.events_dir, self.writer, self.world = plan, events_dir, writer, world_size
        self.items = {i.id: i for i in items}
        self.state = {i.id: _ItemState() for i in items}
        self.finished: set[int] = set()
        self._offsets: dict[Path, int] = {}
        self.last_event = 0.0

    def poll(self) -> list[Item]:
        """Read new events; return the items finished by them."""
        for path in sorted(self.events_dir.glob("rank*.jsonl")):
            with open(path) as fh:
                fh.seek(self._offsets.get(path, 0))
                data = fh.read()
            end = data.rfind("\n") + 1  # only whole lines; the rest is still being written
            self._offsets[path] = self._offsets.get(path, 0) + len(data[:end].encode())
            for line in data[:end].splitlines():
                if line.strip():
                    self._event(json.loads(line))
        newly = []
        for item_id, st in self.state.items():
            if item_id not in self.finished and len(st.done) == self.world:
                self._finish(self.items[item_id])
                newly.append(self.items[item_id])
        return newly

    def _event(self, ev: dict) -> None:
        st = self.state.get(ev["item"])
        if st is None:
            return
        self.last_event = max(self.last_event, ev["time"])
        kind, rank = ev["t"], ev["rank"]
        if kind == "start":
            st.started[rank] = ev["time"]
        elif kind == "phase":
            st.phase[rank] = ev["phase"]
        elif kind == "check":
            st.checks[ev["check"]].append(ev)
        elif kind == "stuck":
            st.stuck.append(ev)
        elif kind == "done":
            st.done.add(rank)

    def in_flight(self) -> Item | None:
        """The earliest unfinished item that some rank has started."""
        started = [i for i, st in self.state.items() if i not in self.finished and st.started]
        return self.items[min(started)] if started else None

    def unfinished(self) -> list[Item]:
        return [self.items[i] for i in sorted(self.state) if i not in self.finished]

    def abort(self, item: Item, reason: str, dead: dict[int, int] | None = None) -> None:
        """Finish `item` as an error: ranks that did not report a check are named, with what they were doing.
        `dead` maps ranks whose process died by itself to their exit codes."""
        dead = dead or {}
        st = self.state[item.id]
        participants = _participants(item)
        stuck_ranks = sorted({r for ev in st.stuck for r in ev["missing"]})
        notes = []
        if stuck_ranks:
            waited = max(ev["waited"] for ev in st.stuck)
            notes.append(f"rank(s) {', '.join(map(str, stuck_ranks))} did not finish the case within {waited:g}s "
                         f"(blocked or dead; " + ", ".join(f"rank {r} in {st.phase.get(r, 'setup')}" for r in stuck_ranks) + ")")
        if dead:
            notes.append("process died: " + ", ".join(f"rank {r} (exit code {c})" for r, c in sorted(dead.items())))
        if reason:
            notes.append(reason)
        for check in item.checks or ["forward"]:
            reported = {ev["rank"] for ev in st.checks.get(check, [])}
            for r in participants:
                if r not in reported:
                    phase = st.phase.get(r, "setup")
                    st.checks[check].append({
                        "rank": r, "coords": None, "check": check, "status": "error",
                        "secondary": bool(dead) and r not in dead,  # killed in the teardown after a peer died
                        "message": "; ".join([f"no result ({'still in ' + phase if r in st.started else 'never started the case'})",
                                              *notes])})
        self._finish(item, extra_message="; ".join(notes))

    def _finish(self, item: Item, extra_message: str = "") -> None:
        st = self.state[item.id]
        participants = _participants(item)
        for check, per_rank in st.checks.items():
            for r in per_rank:
                r.setdefault("coords", None)
                if r["coords"] is None:
                    r["coords"] = _coords_of(r["rank"], item.topology)
            merged = merge_ranks(per_rank, participants)
            if extra_message and merged["status"] != "pass" and extra_message not in merged["message"]:
                merged["message"] = "; ".join(m for m in (merged["message"], extra_message) if m)
            self.writer.write(self._row(item, check, merged))
        self.finished.add(item.id)

    def _row(self, item: Item, check: str, merged: dict) -> dict:
        dp, cp, tp = item.topology
        family = item.op.split(".", 1)[0]
        return {
            "run_id": self.plan.run_id, "op": item.op, "family": family, "impl": self.plan.impl.get(family),
            "suite": item.suite, "case_id": item.case_id, "params": item.params, "dp": dp, "cp": cp, "tp": tp,
            "world_size": item.world_size, "dtype": item.dtype, "device": self.plan.device, "backend": self.plan.backend,
            "seed": item.seed, "check": check, **merged,
        }


def _participants(item: Item) -> list[int]:
    """Ranks that run `item` (replica 0 of its topology)."""
    dp, cp, tp = item.topology
    return list(range(dp * cp * tp))


def _coords_of(rank: int, topology) -> dict:
    dp, cp, tp = topology
    return {"dp": rank // (cp * tp), "cp": (rank // tp) % cp, "tp": rank % tp}
