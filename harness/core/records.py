"""The one data format: results.jsonl (a row per check, `ResultRow`) and run.json (run metadata)."""

from __future__ import annotations

import json
import math
import os
import platform
import socket
import subprocess
import threading
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import torch

if TYPE_CHECKING:
    import pandas as pd

RESULTS = "results.jsonl"
RUN_META = "run.json"


class Status(StrEnum):
    """A check's verdict (`ResultRow.status`), from best to worst."""

    PASS = "pass"
    SKIP = "skip"
    XFAIL = "xfail"  # a known failure (Case.xfail) that failed as expected
    WARN = "warn"  # a clearly labelled difference, not a defect (fails the run only with --strict)
    XPASS = "xpass"  # a known failure that now passes: its mark is stale
    FAIL = "fail"
    ERROR = "error"  # the check could not be judged: the op raised, a rank died or hung

    @property
    def order(self) -> int:
        return _STATUS_ORDER.index(self)


_STATUS_ORDER = list(Status)


class Symptom(StrEnum):
    """What went wrong in a non-passing row (`ResultRow.symptom`); `words` is how the findings name it."""

    VALUES = "values"
    NONFINITE = "nonfinite"
    SHAPE = "shape"
    DTYPE = "dtype"
    OUTPUT_TYPE = "output_type"
    OUTPUTS = "outputs"
    NO_GRADIENT = "no_gradient"
    PRECISION_FLOAT32 = "precision:float32"
    PRECISION_BFLOAT16 = "precision:bfloat16"
    COMM = "comm"
    PROPERTY = "property"
    SIGNATURE = "signature"
    EXCEPTION = "exception"
    DIED = "died"
    HUNG = "hung"
    BLOCKED = "blocked"
    MISSING = "missing"
    REFERENCE = "reference"
    HARNESS = "harness"  # shardcheck's own code raised on a rank: a defect of the harness, not of the op
    XPASS = "xpass"

    @property
    def words(self) -> str:
        return SYMPTOMS[self]


SYMPTOMS = {
    Symptom.VALUES: "wrong values",
    Symptom.NONFINITE: "non-finite values differ (NaN/±inf)",
    Symptom.SHAPE: "wrong shape",
    Symptom.DTYPE: "wrong dtype",
    Symptom.OUTPUT_TYPE: "wrong output type",
    Symptom.OUTPUTS: "wrong number of outputs",
    Symptom.NO_GRADIENT: "no gradient",
    Symptom.PRECISION_FLOAT32: "float64 computed in float32",
    Symptom.PRECISION_BFLOAT16: "bfloat16 math, docs/ops/README.md asks for float32",
    Symptom.COMM: "communication contract",
    Symptom.PROPERTY: "property does not hold",
    Symptom.SIGNATURE: "signature differs from the seed's",
    Symptom.EXCEPTION: "an exception",
    Symptom.DIED: "a rank died",
    Symptom.HUNG: "did not finish within the timeout (blocked in a collective or dead)",
    Symptom.BLOCKED: "blocked or lost its connection after a peer failed",
    Symptom.MISSING: "no result from some ranks",
    Symptom.REFERENCE: "the reference failed on these inputs",
    Symptom.HARNESS: "shardcheck's own code raised (a harness defect, not the op's)",
    Symptom.XPASS: "a known failure now passes: remove its KnownFailure mark",
}


class Phase(StrEnum):
    """Where in a case a rank was, in the order a case runs them."""

    MESH = "mesh"  # the rank builds the topology's device mesh (shardcheck's, before any code of the case)
    SETUP = "setup"
    FORWARD = "forward"
    BACKWARD = "backward"
    JUDGING = "judging"  # the harness compares the outputs or gradients (a lazily waited collective completes here)
    PROPERTIES = "properties"


PHASES = tuple(Phase)
SIGNATURE_CHECK = "property:signature"  # the row of an --impl whose public names or parameters drift from the seed


class _Row(TypedDict):
    run_id: str
    op: str  # family.Name
    family: str
    impl: str | None  # the --impl spec of the family, None for ours
    suite: str
    case_id: str
    params: dict
    dp: int
    cp: int
    tp: int
    world_size: int
    dtype: str
    device: str
    backend: str
    seed: int
    check: str  # forward, forward:<output>, grad:<input>, property:<name>, bench
    status: str  # pass, skip, xfail, warn, xpass, fail, error (shardcheck.harness.core.compare.STATUS_ORDER)
    max_abs_err: float | None
    max_rel_err: float | None
    budget: float | None
    err_ratio: float | None
    err_naive: float | None
    mismatch: dict | None  # the worst element: rank, coords, global_index, local_index, expected, got, kind
    message: str  # for people; shardcheck.harness.findings.causes reads the fields below, never this
    per_rank: list[dict]  # rank, coords, status, max_abs_err, err_ratio of every participating rank
    # What went wrong, as fields (None and [] on a passing row; an xfail row keeps its failure's, an xpass row
    # says "xpass"):
    symptom: str | None  # a key of SYMPTOMS
    culprit_ranks: list[int]  # the ranks whose own result is wrong (that raised, died or did not finish)
    blocked_ranks: list[int]  # the ranks that blocked or lost their connection because of a culprit
    error_type: str | None  # the exception's type name; for a rank that died, its signal or exit code
    error_message: str | None  # the exception's own message (first line)
    error_where: str | None  # path:line where it was raised, in the module under test where the traceback has it
    phase: str | None  # one of PHASES: where the first culprit was when it went wrong


class ResultRow(_Row, total=False):
    """One row of results.jsonl: one check of one item (op, case, topology, dtype)."""

    ep: int  # the expert-parallel part of dp (harness/core/topology.py); rows of older runs lack it (load: 1)
    rerun: str  # on every row but pass and skip: a `shardcheck run` command that runs this item alone
    uses_impl: dict  # on rows of a case that calls other families (Case.uses): {family: its module under test}
    xfail_reason: str  # on xfail and xpass rows: the case's KnownFailure (shardcheck.harness.core.case), its reason
    xfail_reference: str  # and its reference (an upstream issue), "" when it gives none
    rule_source: str | None  # where the check's rule comes from: "seed" or "ours" (shardcheck.harness.core.case.Rule)
    rule_cite: str | None  # the seed's sentence or signature, or our docs/ops section; None where nobody cited it
    # "error" on a row its findings line demoted to `warn` (an exception only on input our rule feeds, under --impl:
    # shardcheck.harness.findings.verdicts); the status the ranks gave it
    demoted_from: str | None
    # on a gradient row of a case accepting several conventions (Case.grad_conventions): the one every rank matched,
    # "summed" or "own" (shardcheck.harness.core.grad_convention); None where they did not all match one
    grad_convention: str | None
    item_seconds: float
    artefact: str  # failures/<item>/<check>.pt (the first failing items)
    error_map: str  # failures/<item>/<check>.png, drawn from the artefact by the report
    time_ms: float  # benchmarks (harness/rank/bench.py): times, memory and collectives
    time_ms_iqr: float
    time_fwd_ms: float
    time_bwd_ms: float
    times_ms: list[float]
    peak_bytes: int
    peak_bytes_fwd: int
    ref_time_ms: float
    ref_time_ms_iqr: float
    ref_times_ms: list[float]
    ref_peak_bytes: int
    expected_peak_bytes: int  # the case's MemoryModel (Case.memory), where it has one
    saved_bytes: int
    memory_model: str
    iters: int
    warmup: int
    comm_calls: dict  # {phase: {kind@dim: calls}}
    comm_bytes: dict
    comm_allowed: dict


ROW_FIELDS = tuple(_Row.__annotations__)  # every row has these
CAUSE_FIELDS = ("symptom", "culprit_ranks", "blocked_ranks", "error_type", "error_message", "error_where", "phase")
NO_CAUSE = {
    "symptom": None,
    "culprit_ranks": [],
    "blocked_ranks": [],
    "error_type": None,
    "error_message": None,
    "error_where": None,
    "phase": None,
}


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
        self._lock = threading.Lock()  # launches of different world sizes write from their own threads
        self.counts = {
            Status.PASS: 0,
            Status.WARN: 0,
            Status.FAIL: 0,
            Status.ERROR: 0,
            Status.SKIP: 0,
            Status.XFAIL: 0,
            Status.XPASS: 0,
        }
        self.shim_calls: dict[str, int] | None = None  # calls the ranks' CPU shims handled; None: never reported

    def count_shim_calls(self, calls: dict[str, int]) -> None:
        """Add the calls a rank's CPU shims handled in one item (a launch reports even when there are none)."""
        with self._lock:
            self.shim_calls = self.shim_calls or {}
            for name, n in calls.items():
                self.shim_calls[name] = self.shim_calls.get(name, 0) + int(n)

    def write(self, row: ResultRow) -> None:
        missing = [k for k in ROW_FIELDS if k not in row]
        if missing:
            raise ValueError(f"result row of {row.get('op')} {row.get('check')} lacks {', '.join(missing)}")
        try:  # nearly every row is finite: the C encoder alone, without walking the row first
            line = json.dumps(row, allow_nan=False)
        except ValueError:
            line = json.dumps(_clean(row))
        with self._lock:
            self.file.write(line + "\n")
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
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=path,
            capture_output=True,
            text=True,
            timeout=10,
        )
        return commit.stdout.strip(), bool(dirty.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        return None, None


def _cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: str) -> dict:
    """What timings depend on: CPU model, core count, the GPU (a CUDA run's), torch version (run.json `machine`)."""
    gpu = torch.cuda.get_device_name(0) if device == "cuda" and torch.cuda.is_available() else None
    return {"cpu": _cpu_model(), "cores": os.cpu_count(), "gpu": gpu, "torch": torch.__version__}


MACHINE_KEYS = ("cpu", "cores", "gpu")  # the hardware: runs that differ here have timings that do not compare


def machine_label(machine: dict | None) -> str:
    if not machine:
        return "machine not recorded"
    return (
        f"{machine.get('cpu')}, {machine.get('cores')} cores"
        + (f", {machine['gpu']}" if machine.get("gpu") else "")
        + f", torch {machine.get('torch')}"
    )


def same_machine(a: dict | None, b: dict | None) -> bool | None:
    """Whether two runs' timings come from the same hardware; None when a run did not record its machine."""
    if not a or not b:
        return None
    return all(a.get(k) == b.get(k) for k in MACHINE_KEYS)


def run_metadata(run_id: str, argv: list[str], device: str, backend: str) -> dict:
    commit, dirty = git_state(Path(__file__).resolve().parent.parent)
    if device == "cuda" and torch.cuda.is_available():
        device_name = torch.cuda.get_device_name(0)
    else:
        device_name = platform.processor() or platform.machine()
    return {
        "run_id": run_id,
        "argv": argv,
        "git_commit": commit,
        "git_dirty": dirty,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "device": device,
        "device_name": device_name,
        "backend": backend,
        "host": socket.gethostname(),
        "machine": machine_info(device),
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


def with_mesh_splits(df: pd.DataFrame) -> pd.DataFrame:
    """`df` with its rows' ep and dp_replicate (1 where rows do not carry them: runs before expert parallelism or
    HSDP, rows made by hand)."""
    splits = {c: df[c].fillna(1).astype(int) if c in df else 1 for c in ("ep", "dp_replicate")}
    return df.assign(**splits)


def load(*paths: str | Path) -> pd.DataFrame:
    """Read the result rows of one or many runs (run dirs, results.jsonl files, or dirs of runs)."""
    import pandas as pd  # the ranks write rows through this module too, and never need pandas

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
    if len(df):  # runs written before rows carried them: ep 1, dp_replicate 1
        df = with_mesh_splits(df)
    for col, empty in NO_CAUSE.items():  # runs written before rows carried these fields
        if col not in df:
            df[col] = [[] for _ in range(len(df))] if isinstance(empty, list) else None
    return df
