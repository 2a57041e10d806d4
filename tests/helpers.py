"""What tests share: run the `shardcheck` CLI, read what it wrote, and the paths of the deliberately wrong or
different implementations (broken/, fixtures/, impls/).  pytest fixtures: conftest.py."""

from __future__ import annotations

import atexit
import contextlib
import io
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from shardcheck.harness import cli as shardcheck_cli
from shardcheck.harness.core.compare import NOT_PASSING
from shardcheck.harness.core.records import load
from shardcheck.harness.driver.pool import WorkerPool, preload_in_ranks
from shardcheck.harness.findings.causes import causes
from shardcheck.harness.findings.wording import finding_lines

ROOT = Path(__file__).resolve().parent.parent
BROKEN = ROOT / "tests" / "broken"  # <suite>/<bug>.py: an op bug the suite must catch, with one cause
FIXTURES = ROOT / "tests" / "fixtures"  # <family>/<behaviour>.py: ranks that hang, die, raise alone, run slow
IMPLS = ROOT / "tests" / "impls"  # honest implementations that differ from ours: no failure allowed


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    out: Path
    # What was read of results.jsonl, kept while the file is unchanged: tests ask a run for its rows and its causes
    # many times (a model run's causes take ~0.6 CPU-s each time).  Each caller gets a copy of its own.
    _read: dict = field(default_factory=dict, repr=False, compare=False)

    def _kept(self, what: str, make: Callable[[], pd.DataFrame]) -> pd.DataFrame:
        results = self.out / "results.jsonl"
        info = results.stat() if results.is_file() else None
        stamp = (info.st_mtime_ns, info.st_size) if info else None
        if stamp is None or self._read.get("stamp") != stamp:
            self._read.clear()
            if stamp is None:  # (a directory of runs, or none yet: read afresh every time)
                return make()
            self._read["stamp"] = stamp
        if what not in self._read:
            self._read[what] = make()
        return self._read[what].copy()

    @property
    def rows(self) -> pd.DataFrame:
        return self._kept("rows", lambda: load(self.out))

    def failed(self) -> pd.DataFrame:
        """Every row that does not pass: warnings (strict runs fail on them), failures, errors."""
        rows = self.rows
        return rows[rows["status"].isin(NOT_PASSING)]

    @property
    def causes(self) -> pd.DataFrame:
        return self._kept("causes", lambda: causes(self.rows))


_POOL: WorkerPool | None = None


def shared_pool() -> WorkerPool:
    """The ranks every in-process run of this test session takes its launches from (one start-up per world size and
    settings, not one per test); ended when the session's process exits."""
    global _POOL
    if _POOL is None:
        # Megatron-Core imported once, by the ranks' fork server, as a default run's ranks get it (harness/cli.py), not
        # by every launch that reaches a Megatron case: 16 ranks of a full session's 30 launches imported it (~1.8
        # CPU-s each).
        preload_in_ranks([shardcheck_cli.MEGATRON_PRELOAD])
        _POOL = WorkerPool(Path(tempfile.mkdtemp(prefix="shardcheck-test-ranks-")))
        atexit.register(_POOL.close)
    return _POOL


def in_process(argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `shardcheck ARGV` run by this process on the shared pool's ranks: what the
    command prints and returns, without a process of its own (its imports) or ranks of its own (theirs)."""
    assert Path.cwd() == ROOT, "the CLI reads ./pyproject.toml: tests run from the repository root"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = shardcheck_cli.main(argv, pool=shared_pool())
        except SystemExit as exc:  # as the interpreter reads it: None is 0, a message is 1
            code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        except Exception:  # what the interpreter would print and exit with
            traceback.print_exc()
            code = 1
    return code, stdout.getvalue(), stderr.getvalue()


def shardcheck(*args: str, out: Path, timeout: float = 600, strict: bool = True, fresh: bool = False) -> Run:
    """`shardcheck ARGS --out OUT` (exit code, output, records).  A `run` is `--strict` unless told otherwise: our
    implementations may not even warn.  It runs in this process on the session's shared ranks; `fresh`: in a
    process of its own, with ranks of its own, as a user runs it (a test of what a run leaves in its folder, of
    process-wide state, of the CLI's own start-up)."""
    extra = ["--strict"] if strict and args and args[0] == "run" else []
    proc = cli(*args, *extra, "--out", str(out), "--no-progress", timeout=timeout, fresh=fresh)
    return Run(proc.returncode, proc.stdout, proc.stderr, out)


def cli(*args: str, timeout: float = 120, fresh: bool = False) -> subprocess.CompletedProcess:
    """Any shardcheck command line (no --out added); in this process unless `fresh` (as `shardcheck`).  `--no-shims`
    runs are always fresh: the shims the other runs installed in this process would stay."""
    if fresh or "--no-shims" in args:
        return subprocess.run(
            [sys.executable, "-m", "shardcheck.harness.cli", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    return subprocess.CompletedProcess(["shardcheck", *args], *in_process(list(args)))


def assert_one_cause(run: Run) -> pd.Series:
    """A run of a broken implementation (one deliberate bug) yields exactly one cause per root, printed among the
    findings: one line per op it breaks, or one line naming several ops when they share the root (a helper they
    all call raising at the same line).  Every failing op is named by exactly one line.  Returns the first."""
    table = run.causes
    ops = set(run.failed()["op"])
    named = [op for cause_ops in table["ops"] for op in cause_ops]
    assert len(table) >= 1 and sorted(named) == sorted(ops), "\n".join(finding_lines(table)) + "\n" + run.stdout[-3000:]
    for cause in table.itertuples():
        assert f"{cause.status.upper()} {cause.op}: {cause.kind}" in run.stdout
    return table.iloc[0]
