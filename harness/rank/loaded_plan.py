"""One plan as a rank runs it: its cases, the modules under test, where its events go, the store its items check in
at; what every item of the plan reads (harness/rank/item_run.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from shardcheck.harness.core.case import Case
from shardcheck.harness.core.events import Events
from shardcheck.harness.core.plan_data import Plan
from shardcheck.harness.rank.fuzz_cases import fuzz_case
from shardcheck.harness.rank.golden import GoldenCache
from shardcheck.harness.rank.signatures import under_test
from shardcheck.harness.rank.suite_loader import suite_cases, suite_fuzz_spaces


@dataclass
class LoadedPlan:
    """A plan and what this rank built for it."""

    plan: Plan
    events: Events  # this rank's events of the plan
    events_dir: Path
    store: dist.Store  # keys of this plan's own: item ids start at 0 in every plan
    device: torch.device
    rank: int
    world: int
    cases: dict[tuple[str, str], Case]  # (op, case id) -> case
    impls: dict[str, object]  # family -> the module under test
    # the ops with a signature row of their own in this plan (harness/driver/run.py): a used family's drift of one of
    # them is not repeated on a model case's row
    ops_with_signature_rows: set[str]
    goldens: GoldenCache = field(default_factory=GoldenCache)
    failures_saved: int = 0  # items whose failure artefacts this rank saved (the plan's failure_artefacts budget)


def plan_cases(plan: Plan) -> dict[tuple[str, str], Case]:
    """Every case the plan's items name, by (op, case id); fuzz cases rebuilt from their drawn params."""
    cases: dict[tuple[str, str], Case] = {}
    for suite in sorted({i.suite for i in plan.items if i.fuzz is None}):
        cases.update({(c.op, c.case_id): c for c in suite_cases(suite, plan.quick, plan.bench, plan.suite_paths)})
    for item in plan.items:
        if item.fuzz is not None:
            space = suite_fuzz_spaces(item.suite, plan.suite_paths)[item.op]
            cases[(item.op, item.case_id)] = fuzz_case(space, item.fuzz)
    return cases


def plan_impls(plan: Plan) -> dict[str, object]:
    """family -> the module under test; someone else's module has its ops called by the seed's parameter names
    (harness/rank/signatures.py)."""
    return {fam: under_test(fam, spec, plan.default_impl.get(fam)) for fam, spec in plan.impl.items()}
