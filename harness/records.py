"""The one data format: results.jsonl (a row per check) and run.json (run metadata)."""

from __future__ import annotations

import json
import math
import platform
import socket
import subprocess
from pathlib import Path

import pandas as pd
import torch

RESULTS = "results.jsonl"
RUN_META = "run.json"


def _clean(value):
    """JSON has no inf/nan: write them as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class RecordWriter:
    """Appends result rows to results.jsonl, flushed row by row."""

    def __init__(self, run_dir: Path):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / RESULTS
        self.file = open(self.path, "a", buffering=1)
        self.counts = {"pass": 0, "warn": 0, "fail": 0, "error": 0, "skip": 0}

    def write(self, row: dict) -> None:
        self.file.write(json.dumps(_clean(row)) + "\n")
        self.file.flush()
        self.counts[row["status"]] = self.counts.get(row["status"], 0) + 1

    def close(self) -> None:
        self.file.close()


def git_state(path: Path) -> tuple[str | None, bool | None]:
    """(commit, dirty) of the git checkout holding `path`, or (None, None)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True, timeout=10)
        if commit.returncode != 0:
            return None, None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=path,
                               capture_output=True, text=True, timeout=10)
        return commit.stdout.strip(), bool(dirty.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return None, None


def run_metadata(run_id: str, argv: list[str], device: str, backend: str) -> dict:
    commit, dirty = git_state(Path(__file__).resolve().parent.parent)
    if device == "cuda" and torch.cuda.is_available():
        device_name = torch.cuda.get_device_name(0)
    else:
        device_name = platform.processor() or platform.machine()
    return {
        "run_id": run_id, "argv": argv, "git_commit": commit, "git_dirty": dirty,
        "torch_version": torch.__version__, "python_version": platform.python_version(),
        "device": device, "device_name": device_name, "backend": backend, "host": socket.gethostname(),
    }


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(_clean(data), indent=2) + "\n")


def _result_files(path: Path) -> list[Path]:
    path = Path(path)
    if path.is_file():
        return [path]
    if (path / RESULTS).is_file():
        return [path / RESULTS]
    return sorted(path.glob(f"*/{RESULTS}"))  # a directory of runs


def load(*paths: str | Path) -> pd.DataFrame:
    """Read the result rows of one or many runs (run dirs, results.jsonl files, or dirs of runs)."""
    files = [f for p in paths for f in _result_files(Path(p))]
    if not files:
        raise FileNotFoundError(f"no {RESULTS} under {', '.join(map(str, paths))}")
    rows = []
    for f in files:
        with open(f) as fh:
            rows.extend(json.loads(line) for line in fh if line.strip())
    df = pd.DataFrame(rows)
    for col in ("max_abs_err", "max_rel_err", "budget", "err_ratio", "err_naive"):
        if col in df:
            df[col] = pd.to_numeric(df[col], errors="coerce")
    return df
