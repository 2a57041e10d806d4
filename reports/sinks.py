"""The end of a run: its rows settled once (shardcheck.harness.findings.verdicts.settle: read once, grouped into
findings once), then handed to each output registered here, in order: the report pages and plots, the benchmark
JSON, the JUnit XML, the GitHub step summary.  An output registers itself with `@sink` (as pytest's junitxml plugin
does) and decides from `Outputs` whether the run asked for it; the entry points call `finish` and nothing else.

The profile's breakdown is not one of them: it reads the driver's own profile, which stops only after the run's
command returns (harness/cli.py, cmd_run)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from shardcheck.harness.findings.verdicts import SettledRun, settle
from shardcheck.reports import benchmark_json, junit, report


@dataclass(frozen=True)
class Outputs:
    """What a run asked for beyond its directory's pages."""

    run_id: str
    junit_xml: Path | None = None  # --junit-xml
    step_summary: str | None = None  # $GITHUB_STEP_SUMMARY, where CI sets it (the CLI's runs only)


Sink = Callable[[SettledRun, Outputs], None]
SINKS: list[Sink] = []


def sink(write: Sink) -> Sink:
    """Register `write` as an output of every run, after those registered before it."""
    SINKS.append(write)
    return write


def finish(run_dir: Path, counts: dict[str, int], outputs: Outputs) -> SettledRun:
    """Settle the run (`counts`: its rows per status as the ranks wrote them) and hand it to every sink once."""
    run = settle(run_dir, counts)
    for write in SINKS:
        write(run, outputs)
    return run


@sink
def _pages(run: SettledRun, outputs: Outputs) -> None:
    report.write(run)


@sink
def _benchmarks(run: SettledRun, outputs: Outputs) -> None:
    benchmark_json.write(run.run_dir, run.rows, run.meta)


@sink
def _junit(run: SettledRun, outputs: Outputs) -> None:
    if outputs.junit_xml:
        junit.write(run.rows, outputs.run_id, outputs.junit_xml)


@sink
def _step_summary(run: SettledRun, outputs: Outputs) -> None:
    if not outputs.step_summary:
        return
    try:
        with open(outputs.step_summary, "a") as fh:
            fh.write(report.summary_markdown(run) + "\n")
    except OSError as exc:
        print(
            f"shardcheck: warning: cannot append to GITHUB_STEP_SUMMARY {outputs.step_summary}: {exc}", file=sys.stderr
        )
