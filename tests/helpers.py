"""What tests share: run the `shardcheck` CLI in a subprocess, read what it wrote, and the paths of the
deliberately wrong or different implementations (broken/, fixtures/, impls/).  pytest fixtures: conftest.py."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from harness.causes import causes, finding_lines
from harness.compare import NOT_PASSING
from harness.records import load

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

    @property
    def rows(self) -> pd.DataFrame:
        return load(self.out)

    def failed(self) -> pd.DataFrame:
        """Every row that does not pass: warnings (strict runs fail on them), failures, errors."""
        rows = self.rows
        return rows[rows["status"].isin(NOT_PASSING)]

    @property
    def causes(self) -> pd.DataFrame:
        return causes(self.rows)


def shardcheck(*args: str, out: Path, timeout: float = 600, strict: bool = True) -> Run:
    """`shardcheck ARGS --out OUT` as a user would run it (exit code, output, records).  A `run` is
    `--strict` unless told otherwise: our implementations may not even warn."""
    extra = ["--strict"] if strict and args and args[0] == "run" else []
    cmd = [sys.executable, "-m", "harness.cli", *args, *extra, "--out", str(out), "--no-progress"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return Run(proc.returncode, proc.stdout, proc.stderr, out)


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Any shardcheck command line (no --out added)."""
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def assert_one_cause(run: Run) -> pd.Series:
    """A run of a broken implementation (one deliberate bug) yields exactly one cause per root, printed among the
    findings: one line per op it breaks, or one line naming several ops when they share the root (a helper they
    all call raising at the same line).  Every failing op is named by exactly one line.  Returns the first."""
    table = run.causes
    ops = set(run.failed()["op"])
    named = [op for cause_ops in table["ops"] for op in cause_ops]
    assert len(table) >= 1 and sorted(named) == sorted(ops), \
        "\n".join(finding_lines(table)) + "\n" + run.stdout[-3000:]
    for cause in table.itertuples():
        assert f"{cause.status.upper()} {cause.op}: {cause.kind}" in run.stdout
    return table.iloc[0]
