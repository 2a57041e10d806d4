"""The command-line options of a run and the exit codes: torch-free, so the CLI reads them before it imports torch."""

from __future__ import annotations

import argparse
from pathlib import Path

from shardcheck.harness.core.topology import UsageError

DEFAULT_TIMEOUT = 60.0  # seconds one case may take (a rerun line leaves it out when it is this)
DEFAULT_WORLD_SIZES = (1, 2, 4)  # the launches of a run that names neither world sizes nor topologies

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


def str_list(values: list[str] | None) -> list[str]:
    """Repeatable, comma-separated option values as one list."""
    return [x.strip() for v in (values or []) for x in v.split(",") if x.strip()]


def impl_map(values: list[str] | None) -> dict[str, str]:
    """`--impl FAMILY=MODULE` options as {family: module}."""
    out = {}
    for v in values or []:
        family, sep, module = v.partition("=")
        if not sep or not family or not module:
            raise UsageError(f"--impl expects FAMILY=MODULE, got {v!r}")
        out[family.strip()] = module.strip()
    return out


def add_suite_path_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--suite-path",
        action="append",
        metavar="PATH",
        help="an external suite file, or a folder of them (repeatable, or comma-separated); "
        "added to those [tool.shardcheck] suite-paths names in ./pyproject.toml",
    )


def add_selection_args(p: argparse.ArgumentParser) -> None:
    """What to run and how: shared by `shardcheck run` and the hand-launched worker."""
    add_suite_path_arg(p)
    p.add_argument("--suite", action="append", help="suite name (repeatable, or comma-separated)")
    p.add_argument("--op", action="append", help="op id family.Name (repeatable, or comma-separated)")
    p.add_argument("--case", action="append", help="case id glob, e.g. 'b4s6*' (repeatable)")
    p.add_argument("--topology", action="append", help="dp=1,cp=1,tp=2 (repeatable)")
    p.add_argument("--dtype", action="append", help="float64,float32,bfloat16,float16")
    p.add_argument("--impl", action="append", help="FAMILY=MODULE or FAMILY=path/to/file.py")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds one case may take on any rank")
    p.add_argument("--quick", action="store_true", help="fewer, smaller cases")
    p.add_argument(
        "--no-shims",
        action="store_true",
        help="do not install shardcheck's CPU shims (torch CP attention on CPU, a Transformer Engine "
        "stand-in): code under test that needs them then fails as it would without them",
    )
    p.add_argument(
        "--corpus",
        type=Path,
        metavar="DIR",
        help="the fuzz corpus whose saved failures run first (default: [tool.shardcheck] fuzz-corpus of "
        "./pyproject.toml, else ./fuzz-corpus)",
    )
    p.add_argument(
        "--strict",
        action="store_true",
        help="a warning (float64 computed in float32, bfloat16 math, collectives beyond the contract, "
        "a signature difference) fails the run too",
    )
