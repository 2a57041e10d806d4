"""The fuzz corpus: each failure `shardcheck fuzz` found and shrank, one small JSON file, replayed first by every
`shardcheck run` of its suite (a regression corpus a team commits beside its code).

Where: `--corpus DIR`, else `[tool.shardcheck] fuzz-corpus` of ./pyproject.toml (relative to it), else
`fuzz-corpus/` in the current directory.  A file holds the suite, the op, the drawn params (they rebuild the case
through the suite's FuzzSpace), the seed its inputs were drawn with, the failure's signature, the module it failed
on and the date.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from shardcheck.harness.core.options import UsageError
from shardcheck.harness.rank.fuzz_cases import canonical, fuzz_case_id
from shardcheck.harness.rank.suite_loader import config_fuzz_corpus

DEFAULT_CORPUS = "fuzz-corpus"
FIELDS = {
    "suite": str,
    "op": str,
    "params": dict,
    "seed": int,
    "signature": list,
    "impl": (str, type(None)),
    "found": str,
}


@dataclass
class CorpusEntry:
    suite: str
    op: str
    params: dict  # the drawn dict: "topology", "dtype" and the op's own parameters
    seed: (
        int  # the fuzz run's --seed: the case's inputs are drawn from it (shardcheck.harness.driver.planner.item_seed)
    )
    signature: list[str]  # the failure: [check, status, symptom or error type]
    impl: str | None  # the module it failed on (None: the family's default)
    found: str = field(default_factory=lambda: dt.date.today().isoformat())

    @property
    def case_id(self) -> str:
        return fuzz_case_id(self.params)

    def file_name(self) -> str:
        return f"{self.op}--{self.case_id}.json"


def corpus_dir(given: Path | None) -> Path:
    """`--corpus`, else the pyproject.toml setting of the current directory, else ./fuzz-corpus."""
    if given is not None:
        return given
    return config_fuzz_corpus(Path.cwd()) or Path(DEFAULT_CORPUS)


def load_corpus(directory: Path) -> list[CorpusEntry]:
    """Every entry of the corpus (none when the folder does not exist), in file-name order.  A file that is not
    an entry: UsageError naming it."""
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"fuzz corpus {directory}: not a directory")
    entries = []
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise UsageError(f"fuzz corpus file {path}: cannot read: {exc}".splitlines()[0]) from None
        bad = [] if isinstance(raw, dict) else ["not a JSON object"]
        if not bad:
            bad = [
                f"{k} must be {getattr(t, '__name__', 'str or null')}"
                for k, t in FIELDS.items()
                if k not in raw or not isinstance(raw[k], t) or (t is int and isinstance(raw[k], bool))
            ]
            bad += [f"unknown key {k}" for k in sorted(set(raw) - set(FIELDS))]
        if not bad:
            params = raw["params"]
            topology = params.get("topology")
            if not (
                isinstance(topology, list)
                and len(topology) == 3
                and all(isinstance(n, int) and n > 0 for n in topology)
            ):
                bad.append("params.topology must be [dp, cp, tp]")
            if not isinstance(params.get("dtype"), str):
                bad.append("params.dtype must be a dtype name")
        if bad:
            raise UsageError(f"fuzz corpus file {path}: not a corpus entry: {'; '.join(bad)}")
        entries.append(CorpusEntry(**raw))
    return entries


def save_entry(directory: Path, entry: CorpusEntry) -> Path:
    """Write `entry` (sorted keys: a committed corpus diffs cleanly); returns its file."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / entry.file_name()
    data = {**asdict(entry), "params": json.loads(canonical(entry.params))}
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return path
