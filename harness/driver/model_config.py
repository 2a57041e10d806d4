"""`shardcheck run --model-config PATH`: the user's Transformers model directory checked as an external suite
written on the fly (suites/_model_config.py builds its cases), so that planning, the ranks, reports, findings and
rerun lines treat it as any other suite.  The path is checked here, before anything runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from shardcheck.harness.core.options import UsageError, str_list
from shardcheck.suites import _model_config

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


def add_model_config_suite(args: argparse.Namespace, run_dir: Path) -> None:
    """With `--model-config`: the path checked (UsageError: one line), its suite written under `run_dir` and added to
    the selection (`--suite-path`, and to `--suite` where suites are named)."""
    if args.model_config is None:
        return
    try:
        _model_config.load(args.model_config)
    except _model_config.ModelConfigError as exc:
        raise UsageError(str(exc)) from None
    config = str(Path(args.model_config).expanduser().resolve())
    folder = run_dir / "model_config"
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / f"{_model_config.SUITE}.py"
    file.write_text(SUITE_SOURCE.format(config=config, family=_model_config.FAMILY))
    args.model_config = config
    args.suite_path = [*(args.suite_path or []), str(file.resolve())]
    if str_list(args.suite) and _model_config.SUITE not in str_list(args.suite):
        args.suite = [*args.suite, _model_config.SUITE]
