"""What the driver hands the ranks: the plan (plan.json) and its items, one (op, case, topology, dtype) each."""

from __future__ import annotations

import fnmatch
import json
from dataclasses import asdict, dataclass, field

import torch

from shardcheck.harness.core.options import RunSettings
from shardcheck.harness.core.topology import Topology

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Xfail:
    """A case's KnownFailure (shardcheck.harness.core.case) resolved for one item: the checks it covers become `xfail`
    while they fail and `xpass` once they pass (shardcheck.harness.driver.collect)."""

    reason: str
    reference: str
    checks: list[str]  # fnmatch patterns over check names

    def covers(self, check: str) -> bool:
        return any(fnmatch.fnmatchcase(check, pattern) for pattern in self.checks)

    def words(self) -> str:
        """'known failure: <reason> (<reference>)', as rows and reports say it."""
        return f"known failure: {self.reason}" + (f" ({self.reference})" if self.reference else "")


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
    xfail: Xfail | None = None  # the case's known failure, where it applies to this item
    skip: str = ""  # why the case cannot run at this topology (planner: its shapes cannot be laid out); "" = runs
    # A fuzz case's drawn parameters: every rank rebuilds the case from them through its suite's FuzzSpace
    # (harness/rank/fuzz_cases.py); None for a case of the suite's cases().
    fuzz: dict | None = None
    dp_replicate: int = 1  # HSDP: dp split replicate x shard (full_topology is the item's Topology)
    ep: int = 1  # expert parallelism (a part of dp: topology[0])

    @property
    def full_topology(self) -> Topology:
        """The item's Topology: its (dp, cp, tp) with dp's split for HSDP and its expert-parallel part."""
        return Topology(*self.topology, ep=self.ep, dp_replicate=self.dp_replicate)


# The suite `run --model-config DIR` writes (harness/driver/model_config.py): its rerun lines name DIR instead.
MODEL_CONFIG_SUITE = "model_config"


@dataclass
class Plan:
    run_id: str
    quick: bool
    settings: RunSettings  # how every item runs (device, --timeout, seed, shims, benchmark), as the run made it
    impl: dict[str, str]
    items: list[Item] = field(default_factory=list)
    failure_artefacts: int = 0  # failing items whose tensors the ranks still save (harness/rank/artefacts.py)
    missing_ops: dict[str, str] = field(default_factory=dict)  # {op: suite} selected but not in the module under test
    suite_paths: list[str] = field(default_factory=list)  # absolute files of the external suites (rank/suite_loader.py)
    # {family: its default module (shardcheck.harness.rank.suite_loader.default_impl)}: what an --impl module's
    # signatures are compared with; None for a new family whose suites name no IMPLEMENTATION.
    default_impl: dict[str, str | None] = field(default_factory=dict)
    model_config: str = ""  # `run --model-config`: the model directory (absolute) its generated suite checks
    profile: str = ""  # a folder: each rank writes its cProfile there (`shardcheck run --profile`); "" = off
    corpus: str = ""  # the fuzz corpus its fuzz items come from (absolute), for their rerun lines
    uses: dict[str, list[str]] = field(default_factory=dict)  # {op: other families its cases call (Case.uses)}

    # The settings read as the plan's own (read-only: a plan's settings are replaced whole, never edited).
    device = property(lambda self: self.settings.device)
    backend = property(lambda self: self.settings.backend)
    timeout = property(lambda self: self.settings.timeout)
    seed = property(lambda self: self.settings.seed)
    shims = property(lambda self: self.settings.shims)
    bench = property(lambda self: self.settings.bench)
    bench_iters = property(lambda self: self.settings.bench_iters)
    bench_warmup = property(lambda self: self.settings.bench_warmup)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        raw = json.loads(text)
        raw["settings"] = RunSettings(**raw["settings"])
        raw["items"] = [
            Item(**{**i, "topology": tuple(i["topology"]), "xfail": Xfail(**i["xfail"]) if i.get("xfail") else None})
            for i in raw["items"]
        ]
        return cls(**raw)
