"""The command-line options of a run, the settings made of them (RunSettings, validated once) and the exit codes:
torch-free, so the CLI reads them before it imports torch."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

DEFAULT_TIMEOUT = 60.0  # seconds one case may take (a rerun line leaves it out when it is this)
DEFAULT_WORLD_SIZES = (1, 2, 4)  # the launches of a run that names neither world sizes nor topologies
DEFAULT_BENCH_ITERS = 10
# Seconds a rank waits on its peers (the launch's rendezvous, one collective) before torch gives up.  A backstop only:
# the driver and the hand-launched run end a hung item at --timeout themselves.  A constant, not the run's --timeout:
# a launch is started before its plan exists and serves plans of any --timeout (harness/driver/pool.py).
PEER_WAIT = 3600.0
# Seconds a rank retries connecting to the store rank 0 hosts.  Rank 0 listens before it writes the port, so only a
# rank 0 that died since (its init_process_group failed) makes its peers wait: they exit and the launch ends, not
# after PEER_WAIT (a minute is ample for a connect on a loaded box).
STORE_CONNECT_WAIT = 60.0

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """Bad usage or configuration: the CLI prints one line and exits 2 (EXIT_USAGE)."""


class UsageParser(argparse.ArgumentParser):
    """An argument parser whose errors are a UsageError: one line and exit 2, no usage dump."""

    def error(self, message: str):
        raise UsageError(message)


@dataclass(frozen=True)
class LaunchSettings:
    """What a launch of ranks is started with (RunSettings.launch); a plan runs only on a launch of its own."""

    device: str
    backend: str
    shims: bool


@dataclass(frozen=True)
class RunSettings:
    """How a run runs its items, validated once where it is made (the CLI's options, or the hand-launched worker's)
    and carried in the plan: the ranks read it from there."""

    device: str
    backend: str
    timeout: float = DEFAULT_TIMEOUT  # seconds one case may take on any rank
    seed: int = 0
    shims: bool = True  # install harness/rank/shims on every rank (only where the real thing cannot run)
    bench: bool = False  # measure time, memory and collectives instead of checking values
    bench_iters: int = DEFAULT_BENCH_ITERS  # timed iterations, the same on every rank
    bench_warmup: int = 2

    def __post_init__(self) -> None:
        if not self.timeout > 0:  # (NaN too)
            raise UsageError(f"--timeout must be positive, got {self.timeout:g}")
        if self.bench_iters <= 0:
            raise UsageError(f"--bench-iters must be positive, got {self.bench_iters}")

    @classmethod
    def of_args(cls, args: argparse.Namespace, device: str, backend: str) -> RunSettings:
        """The settings of parsed options (add_selection_args; `--bench` and `--bench-iters` where the command has
        them) on `device` with `backend`."""
        return cls(
            device=device,
            backend=backend,
            timeout=args.timeout,
            seed=args.seed,
            shims=not args.no_shims,
            bench=getattr(args, "bench", False),
            bench_iters=getattr(args, "bench_iters", DEFAULT_BENCH_ITERS),
        )

    @property
    def launch(self) -> LaunchSettings:
        """What a launch for this run's plans is started with."""
        return LaunchSettings(self.device, self.backend, self.shims)


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


def add_timeout_arg(p: argparse.ArgumentParser, what: str) -> None:
    """`--timeout`, checked where RunSettings is made."""
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help=f"seconds {what} may take on any rank (default: %(default)g)",
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
    p.add_argument("--seed", type=int, default=0, help="every item's inputs are drawn from it (default: %(default)s)")
    add_timeout_arg(p, "one case")
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
