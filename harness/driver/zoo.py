"""The field bug zoo (zoo/, `shardcheck zoo`): its entries, and the one `shardcheck run` that runs their pairs.

Every entry is a suite file of the zoo's folder (shipped with shardcheck as `shardcheck/zoo`) holding a `BUG`
(shardcheck.harness.core.zoo_bug.Bug) and the pair of cases of its op.  All the pairs run in one run: one launch per
world size shared by every pair (each pair's cases run at its own topology only), the broken case in float64, the
fixed twin in float64, float32 and bfloat16.  shardcheck.reports.zoo reads the run back into the recall table."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shardcheck.harness.core.options import UsageError
from shardcheck.harness.core.zoo_bug import FIXED_DTYPES, Bug
from shardcheck.harness.rank.suite_loader import external_suite_files, load_suite


def zoo_dir() -> Path:
    """The zoo's folder: shardcheck/zoo in a wheel, the checkout's own zoo/ (both beside harness/)."""
    return Path(__file__).resolve().parents[2] / "zoo"


@dataclass(frozen=True)
class Entry:
    name: str  # the entry's suite (its file stem), also its family
    path: Path
    bug: Bug


def entries(folder: Path, names: list[str] | None = None) -> list[Entry]:
    """The zoo's entries in `folder`, in name order (`names`: those only; an unknown one is a UsageError)."""
    files = external_suite_files([str(folder)])
    unknown = sorted(set(names or ()) - set(files))
    if unknown:
        raise UsageError(f"no zoo entry named {', '.join(unknown)}; known: {', '.join(sorted(files))}")
    found = []
    for name in sorted(names or files):
        bug = getattr(load_suite(name, [str(folder)]), "BUG", None)
        if not isinstance(bug, Bug):
            raise UsageError(f"zoo entry {files[name]}: defines no BUG (a shardcheck.harness.core.zoo_bug.Bug)")
        found.append(Entry(name, files[name], bug))
    return found


def run_argv(folder: Path, runnable: list[Entry], run_dir: Path, timeout: float | None = None) -> list[str]:
    """The `shardcheck run` command line of the pairs of `runnable` (entries whose bug needs nothing the harness
    lacks): every pair at its topology, in one run into `run_dir`."""
    argv = ["run", "--suite-path", str(folder), "--out", str(run_dir), "--no-progress"]
    for entry in runnable:
        argv += ["--suite", entry.name]
    for topology in sorted({e.bug.topology for e in runnable}):
        argv += ["--topology", topology]
    argv += ["--dtype", ",".join(FIXED_DTYPES)]  # each case keeps its own (Bug: the broken one in float64)
    return argv + (["--timeout", str(timeout)] if timeout is not None else [])
