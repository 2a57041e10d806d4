"""The steps of a run whoever starts its ranks (`shardcheck run`, or a torchrun written by hand:
harness/standalone.py): the selection options and the plan made from them, results.jsonl opened
with run.json and the signature findings before the first case, the summary after the last, and
the exit code."""

from __future__ import annotations

import argparse
import datetime as dt
from dataclasses import asdict
from pathlib import Path

from shardcheck.harness.core.compare import FAILING
from shardcheck.harness.core.options import (
    EXIT_FAIL,
    EXIT_OK,
    RunSettings,
    impl_map,
    str_list,
)
from shardcheck.harness.core.plan_data import Plan
from shardcheck.harness.core.records import RUN_META, RecordWriter, Status, run_metadata, write_json
from shardcheck.harness.core.topology import Topology
from shardcheck.harness.driver.collect import signature_rerun
from shardcheck.harness.driver.corpus import corpus_dir, load_corpus
from shardcheck.harness.driver.planner import Selection, build_plan
from shardcheck.harness.rank import shims
from shardcheck.harness.rank.signatures import signature_rows
from shardcheck.harness.rank.suite_loader import config_suite_paths


def suite_paths(args: argparse.Namespace) -> list[str]:
    """The external suites: `[tool.shardcheck] suite-paths` of ./pyproject.toml, then `--suite-path`."""
    return config_suite_paths(Path.cwd()) + str_list(args.suite_path)


def plan_from_args(
    args: argparse.Namespace,
    settings: RunSettings,
    *,
    run_id: str,
    world_sizes: list[int] | None,
    topologies: list[Topology],
    default_dtypes: list[str],
) -> Plan:
    """The plan of the selection options (add_selection_args) run with `settings`; UsageError when they select nothing
    valid.  The shims are installed first: planning imports the module under test, which may import what they stand
    in for."""
    if settings.shims:
        shims.install(settings.device)
    corpus = corpus_dir(args.corpus).resolve()
    return build_plan(
        Selection(
            run_id=run_id,
            settings=settings,
            suites_wanted=str_list(args.suite),
            ops=str_list(args.op),
            case_patterns=str_list(args.case),
            world_sizes=world_sizes,
            topologies=topologies,
            named_topologies=[Topology.parse(t) for t in args.topology or []],
            dtypes=str_list(args.dtype) or default_dtypes,
            impl=impl_map(args.impl),
            quick=args.quick,
            suite_paths=suite_paths(args),
            corpus=load_corpus(corpus),
            corpus_dir=str(corpus),
        )
    )


def _now() -> str:
    return dt.datetime.now().isoformat(timespec="seconds")


def open_run(run_dir: Path, plan: Plan, argv: list[str]) -> tuple[RecordWriter, dict]:
    """results.jsonl opened, run.json written with the start, and each op whose signature drifted from the
    seed's recorded as one finding before any case runs.  Returns the writer and the run metadata."""
    writer = RecordWriter(run_dir)
    meta = {
        **run_metadata(plan.run_id, argv, plan.device, plan.backend),
        "start": _now(),
        "seed": plan.seed,
        "options": resolved_options(plan),
        "impl": plan.impl,
        **shims.describe(plan.device, plan.shims),
    }
    write_json(run_dir / RUN_META, meta)
    for row in signature_rows(plan, meta):
        writer.write({**row, "rerun": signature_rerun(plan, row["op"], row["suite"])})
    return writer, meta


def resolved_options(plan: Plan) -> dict:
    """What the run ran with, defaults filled in (argv says only what was typed): its settings, and the suites,
    world sizes, topologies and dtypes its items span."""
    return {
        **asdict(plan.settings),
        "quick": plan.quick,
        "suites": sorted({i.suite for i in plan.items}),
        "suite_paths": plan.suite_paths,
        "model_config": plan.model_config,
        "world_sizes": sorted({i.world_size for i in plan.items}),
        "topologies": [str(t) for t in sorted({i.full_topology for i in plan.items})],
        "dtypes": sorted({i.dtype for i in plan.items}),
        "corpus": plan.corpus,
        "profile": plan.profile,
    }


def close_run(run_dir: Path, writer: RecordWriter, meta: dict) -> None:
    """results.jsonl closed; run.json completed with the end and the counts of each status."""
    writer.close()
    usage = {"shim_calls": writer.shim_calls, "shim_notes": shims.usage_notes(meta, writer.shim_calls)}
    write_json(run_dir / RUN_META, {**meta, **usage, "end": _now(), "summary": writer.counts})


def exit_code(counts: dict[str, int], strict: bool) -> int:
    """1 when a check failed or errored, a known failure passed (xpass: its mark must go), or a check warned
    under --strict; else 0.  A known failure that still fails (xfail) never fails a run."""
    failed = any(counts.get(status, 0) for status in FAILING)
    return EXIT_FAIL if failed or (strict and counts.get(Status.WARN, 0)) else EXIT_OK
