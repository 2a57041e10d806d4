"""Where each rank of a hung case is: its Python stack, taken on request, read as "running" or "waiting".

Every rank registers faulthandler on SIGUSR1 (harness/rank/worker.py serve), writing all its threads' stacks to
LAUNCH_DIR/rank<R>.stacks; faulthandler's handler is C, so it answers while the rank spins in Python or blocks in
gloo's C++.  Before the driver ends a hung launch it signals every live rank (`take`), and `describe` turns each
rank's main-thread stack into a line: "running in FILE:LINE FUNC ← CALLER" (computing: a loop, a kernel) or
"waiting in all_reduce ... at FILE:LINE" (its innermost frames are torch.distributed's: a collective, a wait on a
functional collective's result, a store get), or "at the case's barrier" (it finished its part)."""

from __future__ import annotations

import os
import re
import signal
import sysconfig
import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from shardcheck.harness.core.events import stack_path

STACK_WAIT = 2.0  # seconds the driver waits for the ranks' dumps (a loaded machine schedules them late)

TIMER_HEADER = "Timeout ("  # how faulthandler.dump_traceback_later starts a dump
_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+")
_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')
_TORCH_DIST = f"{os.sep}torch{os.sep}distributed{os.sep}"
_TORCH = f"{os.sep}torch{os.sep}"
# torch.distributed's files where a rank waits for its peers (a collective, a functional collective's result, the store)
_WAITS_IN = {
    "distributed_c10d.py",
    "_functional_collectives.py",
    "c10d_logger.py",
    "_collective_utils.py",
    "rendezvous.py",
}
_WORKER = f"{os.sep}rank{os.sep}worker.py"
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    def text(self) -> str:
        return f"{short_path(self.file)}:{self.line} {self.func}"


class State(StrEnum):
    RUNNING = "running"
    WAITING = "waiting"
    BARRIER = "barrier"


def short_path(path: str) -> str:
    """A frame's file for people: relative to the working directory when inside it, torch's from `torch/`, the
    standard library's from its package (`re/__init__.py`)."""
    p = Path(path)
    if p.is_absolute() and p.is_relative_to(Path.cwd()):
        return str(p.relative_to(Path.cwd()))
    if _TORCH in path:
        return "torch" + os.sep + path.rsplit(_TORCH, 1)[1]
    if path.startswith(_STDLIB) and "site-packages" not in path:
        return path.removeprefix(_STDLIB)
    return path


def take(launch_dir: Path, ranks: list[int], pids: dict[int, int]) -> dict[int, str]:
    """Ask each live rank in `ranks` for its stacks (SIGUSR1); {rank: the dump's text} for those that answered
    within STACK_WAIT seconds."""
    before = {}
    for rank in ranks:
        path = stack_path(launch_dir, rank)
        before[rank] = path.stat().st_size if path.exists() else 0
        try:
            os.kill(pids[rank], signal.SIGUSR1)
        except (KeyError, ProcessLookupError, PermissionError):
            before.pop(rank)
    dumps: dict[int, str] = {}
    deadline = time.time() + STACK_WAIT
    while before and time.time() < deadline:
        for rank in list(before):
            text = _read_from(stack_path(launch_dir, rank), before[rank])
            # a dump is whole once its last thread's frames end (faulthandler writes no end marker: wait a beat)
            if text and _THREAD.match(text.splitlines()[0]):
                time.sleep(0.05)
                dumps[rank] = _read_from(stack_path(launch_dir, rank), before.pop(rank))
        time.sleep(0.02)
    return dumps


def dumped_since(launch_dir: Path, ranks: list[int], since: float, wait: float = STACK_WAIT) -> dict[int, str]:
    """The dumps ranks wrote themselves (faulthandler.dump_traceback_later, a hand-launched run's ranks) after
    `since` (a time.time()): {rank: its last dump} for those in `ranks` whose dump came within `wait` seconds."""
    dumps: dict[int, str] = {}
    deadline = time.time() + wait
    while True:
        for rank in ranks:
            path = stack_path(launch_dir, rank)
            try:
                fresh = path.stat().st_mtime >= since
            except OSError:
                continue
            text = _read_from(path, 0).rsplit(TIMER_HEADER, 1)
            if fresh and len(text) == 2 and rank not in dumps:
                time.sleep(0.05)  # (no end marker: let the dump finish)
                dumps[rank] = TIMER_HEADER + _read_from(path, 0).rsplit(TIMER_HEADER, 1)[1]
        if len(dumps) == len(ranks) or time.time() > deadline:
            return dumps
        time.sleep(0.05)


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, errors="replace") as fh:
            fh.seek(offset)
            return fh.read()
    except OSError:
        return ""


def main_stack(dump: str) -> list[Frame]:
    """The rank's main thread (the one running the worker's serve; else the deepest), innermost frame first."""
    threads: list[list[Frame]] = []
    for line in dump.splitlines():
        if _THREAD.match(line):
            threads.append([])
        elif (m := _FRAME.match(line)) and threads:
            threads[-1].append(Frame(m["file"], int(m["line"]), m["func"]))
    serving = [t for t in threads if any(f.func == "serve" and f.file.endswith(_WORKER) for f in t)]
    return (serving or sorted(threads, key=len, reverse=True) or [[]])[0]


def state(frames: list[Frame]) -> State:
    """RUNNING, WAITING (inside torch.distributed) or BARRIER (the worker's own wait after the case)."""
    if not frames:
        return State.RUNNING
    inner = frames[0]
    if inner.file.endswith(_WORKER) and inner.func in ("barrier", "run"):
        return State.BARRIER
    if _TORCH_DIST in inner.file and os.path.basename(inner.file) in _WAITS_IN:
        return State.WAITING
    return State.RUNNING


def _outside_torch(frames: list[Frame], start: int = 0) -> Frame | None:
    return next((f for f in frames[start:] if _TORCH not in f.file), None)


def _collective(frames: list[Frame]) -> str:
    """The torch.distributed function a waiting rank is in: the outermost of its innermost torch.distributed frames
    that is not a decorator's wrapper (`all_reduce`, `wait_tensor`, `_store_based_barrier`)."""
    name = "a collective"
    for f in frames:
        if _TORCH_DIST not in f.file:
            break
        if f.func not in ("wrapper", "inner", "<lambda>", "__call__") and not f.func.startswith("_"):
            name = f.func
    return name


def describe(frames: list[Frame], last_record: dict | None = None) -> str:
    """One rank in words.  `last_record`: its last flight record in the case, which names a waiting rank's
    collective by kind, number and mesh dim."""
    what = state(frames)
    if what == State.BARRIER:
        return "finished its part, waiting for the others at the case's barrier"
    if what == State.WAITING:
        caller = _outside_torch(frames)
        if last_record is not None:
            return (
                f"waiting in {last_record['kind']} #{last_record['seq']} on {last_record['dim']} at "
                f"{where_text(last_record['where'])}"
            )
        return f"waiting in {_collective(frames)}" + (f" at {caller.text()}" if caller else "")
    if not frames:
        return "running (no Python frame: in native code)"
    inner = running_frame(frames)
    caller = _outside_torch(frames, 0 if _TORCH in inner.file else 1)
    return f"running in {inner.text()}" + (f" ← {caller.text()}" if caller and caller != inner else "")


def running_frame(frames: list[Frame]) -> Frame:
    """The frame a running rank is named by: its innermost, except that a generic torch helper (a shape guard of
    torch/fx, a prims utility) called from torch.distributed gives way to that torch.distributed frame: a loop
    in DTensor's sharding propagation samples in either, and the distributed one is the loop's (the same line
    whichever sample the dump took)."""
    inner = frames[0]
    if _TORCH not in inner.file or _TORCH_DIST in inner.file:
        return inner
    for f in frames[1:]:
        if _TORCH not in f.file:
            return inner
        if _TORCH_DIST in f.file:
            return f
    return inner


def where_text(where: str) -> str:
    """A flight record's "FILE:LINE FUNC" with the file shortened."""
    file, _, rest = where.rpartition(":")
    return f"{short_path(file)}:{rest}" if file else where


def describe_ranks(dumps: dict[int, str], last_records: dict[int, dict]) -> tuple[str, list[int], str | None]:
    """(the ranks in words, ranks with the same words together; the ranks that were running; the first running
    rank's innermost frame as FILE:LINE, or None)."""
    words: dict[str, list[int]] = {}
    running, where = [], None
    for rank in sorted(dumps):
        frames = main_stack(dumps[rank])
        what = state(frames)
        words.setdefault(describe(frames, last_records.get(rank) if what == State.WAITING else None), []).append(rank)
        if what == State.RUNNING:
            running.append(rank)
            if where is None and frames:
                named = running_frame(frames)
                where = f"{short_path(named.file)}:{named.line}"
    text = "; ".join(f"{'rank' if len(rs) == 1 else 'ranks'} {', '.join(map(str, rs))}: {w}" for w, rs in words.items())
    return text, running, where
