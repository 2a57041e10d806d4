"""What a run ran with, for whoever reads it later: run.json's seed and resolved options, `--help`'s defaults, and
the example suites a wheel user can copy out to run the docs' `--suite-path examples/...` commands."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from shardcheck.harness.cli import main
from shardcheck.harness.cli_parser import make_parser

ROOT = Path(__file__).resolve().parents[1]


def test_run_json_holds_the_seed_and_the_resolved_options(tmp_path):
    # planned skips only (16 positions over CP 3): no rank starts, run.json is written all the same
    out = tmp_path / "run"
    argv = ["run", "--suite", "model_utils_cp", "--case", "cp-shard1-*", "--topology", "dp=1,cp=3,tp=1"]
    assert main([*argv, "--dtype", "float64", "--quick", "--seed", "7", "--no-progress", "--out", str(out)]) == 0
    meta = json.loads((out / "run.json").read_text())
    assert meta["seed"] == 7
    options = meta["options"]
    assert options["seed"] == 7 and options["timeout"] == 60.0 and options["quick"] is True  # a default filled in
    assert options["bench_iters"] == 10 and options["shims"] is True and options["device"] == "cpu"
    assert options["topologies"] == ["dp1-cp3-tp1"] and options["world_sizes"] == [3]
    assert options["dtypes"] == ["float64"] and options["suites"] == ["model_utils_cp"]


@pytest.mark.parametrize(
    ("command", "option", "default"),
    [("run", "--seed", "0"), ("run", "--timeout", "60"), ("run", "--bench-iters", "10"), ("fuzz", "--seed", "0")],
)
def test_help_shows_the_defaults(command, option, default):
    sub = next(a for a in make_parser()._subparsers._group_actions if a.dest == "command").choices[command]
    action = next(a for a in sub._actions if option in a.option_strings)
    assert f"default: {default})" in sub._get_formatter()._expand_help(action)


def test_examples_copies_the_example_suites_into_a_new_folder(tmp_path, capsys):
    dest = tmp_path / "examples"
    assert main(["examples", str(dest)]) == 0
    shipped = sorted(p.relative_to(ROOT / "examples") for p in (ROOT / "examples").glob("*/*.py"))
    assert sorted(p.relative_to(dest) for p in dest.rglob("*") if p.is_file()) == shipped
    assert (dest / "torch_loss_parallel" / "torch_loss_parallel.py").read_text() == (
        ROOT / "examples" / "torch_loss_parallel" / "torch_loss_parallel.py"
    ).read_text()
    capsys.readouterr()
    assert main(["examples", str(dest)]) == 2  # never over a folder that exists
    assert f"{dest} exists; name a new folder" in capsys.readouterr().err


def test_the_wheel_ships_every_example_suite():
    """`shardcheck examples` copies from the installed shardcheck/examples: the wheel must hold each of them."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"]["shardcheck.examples"] == "examples"
    assert "shardcheck.examples" in config["packages"]
    patterns = config["package-data"]["shardcheck.examples"]
    files = [
        p.relative_to(ROOT / "examples") for p in (ROOT / "examples").rglob("*.py") if "__pycache__" not in p.parts
    ]
    assert files and all(any(f.match(pattern) for pattern in patterns) for f in files), files
