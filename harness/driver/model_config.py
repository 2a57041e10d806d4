"""`shardcheck run --model-config PATH`: the user's Transformers model directory, or torchtitan job arguments
(`"--module llama3 --config llama3_8b ..."`), checked as an external suite written on the fly
(suites/_model_config.py, suites/_titan_config.py build its cases), so that planning, the ranks, reports, findings
and rerun lines treat it as any other suite.  The path or job is checked here, before anything runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shardcheck.harness.core.options import UsageError, str_list
from shardcheck.harness.rank.shims import triton_import
from shardcheck.suites import _model_config, _titan_config

SUITE_SOURCE = '''"""Written by `shardcheck run --model-config {config}`:
that model directory's cases (suites/_model_config.py)."""

from shardcheck.suites import _model_config

FAMILY = "{family}"
IMPLEMENTATION = __file__
CONFIG = {config!r}


def parallelize(model, ctx):
    """Transformers' own tensor-parallel plan at the topology's tp."""
    return _model_config.hf.parallelize(expert_parallel=False)(model, ctx)


def cases(quick: bool = False):
    return _model_config.cases(CONFIG)
'''


TITAN_SUITE_SOURCE = '''"""Written by `shardcheck run --model-config CONFIG`: that torchtitan job's case
(suites/_titan_config.py)."""

from shardcheck.suites import _titan_config

FAMILY = "{family}"
IMPLEMENTATION = __file__
CONFIG = {config!r}


def parallelize(model, ctx):
    """torchtitan's own parallelize at the job's degrees (the plan of the job's one case)."""
    return _titan_config.cases(CONFIG)[0].parallelize(model, ctx)


def cases(quick: bool = False):
    return _titan_config.cases(CONFIG)
'''


def _titan_job(args: argparse.Namespace) -> str:
    """The torchtitan job checked (UsageError: one line), what its degrees became said, its topology selected where
    the run names none."""
    if triton_import.wanted():  # torchtitan's config registries import Triton (harness/rank/shims/triton_import.py)
        triton_import.install()
    try:
        model, _, mapping = _titan_config.plan(args.model_config)
    except _model_config.ModelConfigError as exc:
        raise UsageError(str(exc)) from None
    reduced = "; ".join(mapping.notes) or "nothing reduced"
    print(f"shardcheck: torchtitan job: {model} at {mapping.topology} ({reduced})", file=sys.stderr)
    if not args.topology:
        args.topology = [mapping.topology]
    return TITAN_SUITE_SOURCE.format(config=args.model_config, family=_titan_config.FAMILY)


def _model_directory(args: argparse.Namespace) -> str:
    """The model directory checked (UsageError: one line); `args.model_config` made absolute."""
    try:
        _model_config.load(args.model_config)
    except _model_config.ModelConfigError as exc:
        raise UsageError(str(exc)) from None
    config = str(Path(args.model_config).expanduser().resolve())
    args.model_config = config
    return SUITE_SOURCE.format(config=config, family=_model_config.FAMILY)


def add_model_config_suite(args: argparse.Namespace, run_dir: Path) -> None:
    """With `--model-config`: the path or job checked (UsageError: one line), its suite written under `run_dir` and
    added to the selection (`--suite-path`, and to `--suite` where suites are named)."""
    if args.model_config is None:
        return
    titan = _titan_config.is_job_config(args.model_config)
    source = _titan_job(args) if titan else _model_directory(args)
    folder = run_dir / "model_config"
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / f"{_model_config.SUITE}.py"
    file.write_text(source)
    args.suite_path = [*(args.suite_path or []), str(file.resolve())]
    if str_list(args.suite) and _model_config.SUITE not in str_list(args.suite):
        args.suite = [*args.suite, _model_config.SUITE]
