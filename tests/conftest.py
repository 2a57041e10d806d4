"""pytest fixtures; what tests share otherwise is in helpers.py."""

from __future__ import annotations

import pytest
from helpers import BROKEN, FIXTURES, Run, assert_one_cause, shardcheck


@pytest.fixture
def run_shardcheck(tmp_path):
    counter = iter(range(1000))

    def _run(*args: str, timeout: float = 600, strict: bool = True, fresh: bool = False) -> Run:
        run = shardcheck(*args, out=tmp_path / f"run{next(counter)}", timeout=timeout, strict=strict, fresh=fresh)
        return _checked(args, run)

    return _run


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory):
    """`run_shardcheck` for runs that several tests assert on: a command line is run once per session, and every test
    that asks for it again gets the same Run (its folder is shared: read it, never write to it)."""
    runs: dict[tuple[str, ...], Run] = {}

    def _run(*args: str) -> Run:
        if args not in runs:
            runs[args] = _checked(args, shardcheck(*args, out=tmp_path_factory.mktemp("shared") / "run"))
        return runs[args]

    return _run


def _checked(args: tuple[str, ...], run: Run) -> Run:
    """The run, after the check every run of a broken op gets: exactly one cause per broken op."""
    if any(str(BROKEN) in a or str(FIXTURES) in a for a in args):
        assert_one_cause(run)
    return run
