"""Shared helpers: run the `shardcheck` CLI in a subprocess and read what it wrote."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest

from harness.records import load

ROOT = Path(__file__).resolve().parent.parent
BROKEN = Path(__file__).resolve().parent / "broken"


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
        rows = self.rows
        return rows[rows["status"].isin(["fail", "error"])]


def shardcheck(*args: str, out: Path, timeout: float = 600) -> Run:
    """`shardcheck ARGS --out OUT` as a user would run it (exit code, output, records)."""
    cmd = [sys.executable, "-m", "harness.cli", *args, "--out", str(out), "--no-progress"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return Run(proc.returncode, proc.stdout, proc.stderr, out)


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Any shardcheck command line (no --out added)."""
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture
def run_shardcheck(tmp_path):
    counter = iter(range(1000))

    def _run(*args: str, timeout: float = 600) -> Run:
        return shardcheck(*args, out=tmp_path / f"run{next(counter)}", timeout=timeout)

    return _run
