"""What the driver hands the ranks: the plan (plan.json) and its items, one (op, case, topology, dtype) each."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import torch

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_TIMEOUT = 60.0  # seconds one case may take (a rerun line leaves it out when it is this)


@dataclass
class Item:
    id: int
    suite: str
    op: str
    case_id: str
    dtype: str
    topology: tuple[int, int, int]
    world_size: int
    seed: int
    checks: list[str]  # checks every participating rank must report
    params: dict = field(default_factory=dict)  # the case's parameters, recorded in each row


@dataclass
class Plan:
    run_id: str
    quick: bool
    seed: int
    timeout: float
    device: str
    backend: str
    impl: dict[str, str]
    items: list[Item] = field(default_factory=list)
    bench: bool = False  # measure time, memory and collectives instead of checking values
    bench_iters: int = 10  # timed iterations, the same on every rank
    bench_warmup: int = 2
    failure_artefacts: int = 0  # failing items whose tensors the ranks still save (harness/artefacts.py)
    missing_ops: dict[str, str] = field(default_factory=dict)  # {op: suite} selected but not in the module under test
    shims: bool = True  # install harness/shims on every rank (only where the real thing cannot run)
    profile: str = ""  # a folder: each rank writes its cProfile there (`shardcheck run --profile`); "" = off

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        raw = json.loads(text)
        raw["items"] = [Item(**{**i, "topology": tuple(i["topology"])}) for i in raw["items"]]
        return cls(**raw)
