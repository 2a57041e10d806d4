"""The command line of `shardcheck`: its commands and their options.  Torch-free, so that `--help` and bad usage are
quick; what the options mean is checked where they are used (RunSettings: --timeout, --bench-iters)."""

from __future__ import annotations

import argparse
from pathlib import Path

from shardcheck.harness.core.options import (
    DEFAULT_BENCH_ITERS,
    UsageError,
    UsageParser,
    add_selection_args,
    add_suite_path_arg,
    add_timeout_arg,
)

DEFAULT_FUZZ_EXAMPLES = 100


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"expected comma-separated integers, got {text!r}") from None


def make_parser() -> argparse.ArgumentParser:
    p = UsageParser(prog="shardcheck", description="Correctness and benchmark harness for sharded PyTorch ops.")
    sub = p.add_subparsers(dest="command", parser_class=UsageParser)
    _add_run_parser(sub)
    _add_fuzz_parser(sub)
    lst = sub.add_parser("list", help="ops, suites and default topologies")
    lst.add_argument("--quick", action="store_true")
    lst.add_argument("--corpus", type=Path, metavar="DIR", help="the fuzz corpus to count (default as for run)")
    add_suite_path_arg(lst)
    ex = sub.add_parser("examples", help="copy the example suites (the docs' --suite-path examples/...) into DIR")
    ex.add_argument("dir", type=Path, nargs="?", default=Path("examples"), help="a new folder (default: %(default)s)")
    zoo = sub.add_parser("zoo", help="the field bug zoo: every pair (or those named) in one run, the recall table")
    zoo.add_argument("names", nargs="*", metavar="NAME", help="zoo entries (default: all)")
    zoo.add_argument("--out", type=Path, help="run directory (default shardcheck-runs/zoo-<stamp>)")
    zoo.add_argument("--timeout", type=float, help="seconds one case may take on any rank (as for run)")
    rep = sub.add_parser("report", help="(re)build the report of run directories")
    rep.add_argument("dirs", nargs="+", type=Path)
    cmp = sub.add_parser("compare", help="regression gate between two runs (Markdown table; exit 1 on regression)")
    cmp.add_argument("base", type=Path)
    cmp.add_argument("new", type=Path)
    cmp.add_argument("--max-slowdown", type=float, default=10.0, metavar="PCT")
    cmp.add_argument("--max-memory-growth", type=float, default=5.0, metavar="PCT")
    dash = sub.add_parser("dashboard", help="one HTML page over many runs: time, memory, regressions, pass/fail")
    dash.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR")
    dash.add_argument("--out", type=Path, default=Path("shardcheck-dashboard"), help="output directory")
    dash.add_argument("--max-slowdown", type=float, default=10.0, metavar="PCT")
    dash.add_argument("--max-memory-growth", type=float, default=5.0, metavar="PCT")
    return p


def _add_run_parser(sub) -> None:
    run = sub.add_parser("run", help="run suites (default: everything, default matrix, then the report)")
    add_selection_args(run)
    run.add_argument("--world-sizes", type=_int_list, help="world sizes to launch, e.g. 1,2,4")
    run.add_argument(
        "--model-config",
        metavar="DIR|JOB",
        help="a Transformers model directory (config.json, as save_pretrained writes; no weights), or a torchtitan "
        "job's arguments ('--module llama3 --config llama3_8b --parallelism.tensor_parallel_degree 8'): the same "
        "model at a small size, random weights, under the framework's own plan (docs/third-party-models.md)",
    )
    run.add_argument("--out", type=Path, help="run directory (default shardcheck-runs/<run-id>)")
    run.add_argument("--bench", action="store_true", help="measure time, memory and collectives (benchmark cases)")
    run.add_argument(
        "--bench-iters",
        type=int,
        default=DEFAULT_BENCH_ITERS,
        help="timed iterations per benchmark (all ranks; default: %(default)s)",
    )
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument(
        "--no-hang-budget",
        action="store_true",
        help="after an op hangs or a rank dies at a topology, still try its remaining items there "
        "(default: record them as skipped)",
    )
    run.add_argument("--junit-xml", type=Path, metavar="PATH", help="also write JUnit XML (one testcase per item)")
    run.add_argument(
        "--profile",
        action="store_true",
        help="cProfile the driver and every rank: <run>/profile/*.prof and breakdown.md (where the time goes)",
    )


def _add_fuzz_parser(sub) -> None:
    fz = sub.add_parser(
        "fuzz",
        help="draw cases from each op's fuzz space, shrink the first failure, save it to the corpus `run` replays",
    )
    add_suite_path_arg(fz)
    fz.add_argument("--suite", action="append", help="suite name (repeatable, or comma-separated)")
    fz.add_argument("--op", action="append", help="op id family.Name (repeatable, or comma-separated)")
    fz.add_argument("--impl", action="append", help="FAMILY=MODULE or FAMILY=path/to/file.py")
    fz.add_argument(
        "--examples",
        type=int,
        help=f"examples per op (default {DEFAULT_FUZZ_EXAMPLES}; with --time: until the time is up)",
    )
    fz.add_argument("--time", type=float, metavar="SECONDS", help="wall-clock budget of the whole search")
    fz.add_argument("--seed", type=int, default=0, help="the same seed draws the same examples (default: %(default)s)")
    fz.add_argument("--topology", action="append", help="dp=1,cp=1,tp=2 (repeatable): the topologies to draw from")
    fz.add_argument("--world-sizes", type=_int_list, help="draw from every topology of these sizes (default 1,2,4)")
    fz.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when available")
    add_timeout_arg(fz, "one example")
    fz.add_argument("--no-hang-budget", action="store_true", help="(as for run; an example is a single item)")
    fz.add_argument("--no-shims", action="store_true", help="do not install shardcheck's CPU shims (as for run)")
    fz.add_argument("--out", type=Path, help="run directory (default shardcheck-runs/fuzz-<run-id>)")
    fz.add_argument(
        "--corpus",
        type=Path,
        metavar="DIR",
        help="where shrunk failures are saved (default: [tool.shardcheck] fuzz-corpus of ./pyproject.toml, "
        "else ./fuzz-corpus)",
    )
    fz.add_argument("--no-progress", action="store_true", help="no line per example")
