"""What the driver learns of a case that hung or lost a rank, before it ends the launch: every live rank's stack
(harness/driver/stacks.py), the ranks' collectives compared (harness/driver/flight.py), each dead rank's last error
lines (harness/driver/last_words.py).  The words go into the finding (Collector.abort); the whole stacks, the
records and the dead ranks' log ends go to failures/<item>/ (hang-stacks.txt, collectives.txt, rank<R>.log), and
the records again in torch's flight recorder format (torch-flight-recorder/, harness/driver/flight_dump.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from shardcheck.harness.core.plan_data import Item
from shardcheck.harness.driver import flight, flight_dump, last_words, stacks
from shardcheck.harness.driver.pool import Launch, rank_log
from shardcheck.harness.rank import flight_recorder
from shardcheck.harness.rank.artefacts import item_dir_name

LOG_TAIL = 200  # lines of a dead rank's log kept with the failure


@dataclass
class Postmortem:
    text: str = ""  # the finding's words: where each live rank was, then the collectives compared
    culprits: list[int] = field(
        default_factory=list
    )  # ranks the evidence names (odd collective, never entered, running)
    where: str | None = None  # the first culprit's FILE:LINE
    last_words: dict[int, str] = field(default_factory=dict)  # dead rank -> its last error lines
    artefacts: str | None = None  # failures/<item>/, relative to the run folder


def take(launch: Launch, item: Item, plan_index: int, deaths: dict[int, str], run_dir: Path) -> Postmortem:
    dp, cp, tp = item.topology
    participants = list(range(dp * cp * tp))
    pids = launch.pids()
    dumps = stacks.take(launch.dir, [r for r in participants if r in pids], pids)
    return of_dumps(launch.dir, item, plan_index, dumps, deaths, run_dir)


def of_dumps(
    launch_dir: Path, item: Item, plan_index: int, dumps: dict[int, str], deaths: dict[int, str], run_dir: Path
) -> Postmortem:
    """The postmortem from the ranks' stack dumps ({rank: text}) and the records and logs in `launch_dir`: the
    driver's (`take`), or a hand-launched run's rank 0 reading what its peers dumped (harness/standalone.py)."""
    dp, cp, tp = item.topology
    participants = list(range(dp * cp * tp))
    records = flight.case_records(launch_dir, participants, plan_index, item.id)
    compared = flight.compare(records, (*item.topology, item.ep))
    ranks_text, running, running_where = stacks.describe_ranks(dumps, flight.last_records(records))
    words = {r: last_words.of_rank(launch_dir, r) for r in sorted(deaths) if r in participants}
    off = "" if flight_recorder.enabled() else f"no collectives recorded ({flight_recorder.SWITCH}=0)"
    text = "; ".join(t for t in (ranks_text, compared.text, off) if t)
    # the collectives name who left the others; else the ranks computing while the others wait
    waiting_somewhere = len(running) < len(dumps)
    culprits = compared.culprits or (running if waiting_somewhere else [])
    where = compared.where or running_where
    folder = _save(run_dir, item, dumps, records, deaths, launch_dir)
    return Postmortem(text, culprits, where, words, folder)


def startup_stacks(launch: Launch) -> str:
    """Where each live rank of a launch that never began its first item was, as words appended to the watchdog's
    reason: "; ranks 0, 2: running in my_suite.py:12 cases; rank 1: waiting in ...", or "" when none answered."""
    pids = launch.pids()
    dumps = stacks.take(launch.dir, sorted(pids), pids)
    text, _, _ = stacks.describe_ranks(dumps, {})
    return f"; before their first item, {text}" if text else ""


def _save(
    run_dir: Path,
    item: Item,
    dumps: dict[int, str],
    records: dict[int, list[dict]],
    deaths: dict[int, str],
    launch_dir: Path,
) -> str | None:
    if not dumps and not any(records.values()) and not deaths:
        return None
    out = run_dir / "failures" / item_dir_name(item)
    out.mkdir(parents=True, exist_ok=True)
    if dumps:
        (out / "hang-stacks.txt").write_text("".join(f"=== rank {r} ===\n{dumps[r]}\n" for r in sorted(dumps)))
    if any(records.values()):
        (out / "collectives.txt").write_text(flight.as_text(records))
        flight_dump.write(
            out, records, (*item.topology, item.ep)
        )  # the same records, for torch's analyzer (torchfrtrace)
    for rank in deaths:
        try:
            lines = rank_log(launch_dir, rank).read_text(errors="replace").splitlines()[-LOG_TAIL:]
        except OSError:
            continue
        (out / f"rank{rank}.log").write_text("\n".join(lines) + "\n")
    return str(Path("failures", out.name)) + "/"
