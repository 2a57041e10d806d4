"""pytest fixtures; what tests share otherwise is in helpers.py."""

from __future__ import annotations

import pytest
from helpers import BROKEN, FIXTURES, Run, assert_one_cause, shardcheck

# The longest files first (their serial wall seconds, 2026-11-29, docs/performance.md): the test processes take
# files in collection order (`--no-loadscope-reorder`, pyproject.toml), so the long ones do not meet at the end with
# one process idle, and the hang tests' waits start beside other files' computing.  A file not listed runs after
# these, in pytest's order; a stale list costs time, never a test.
LONGEST_FIRST = (
    "test_hang_findings.py",  # 148 s, most of it waiting out hangs
    "test_model_case.py",  # 54
    "test_third_party_models.py",  # 40
    "test_fuzz.py",  # 40
    "test_model_case_steps.py",  # 37
    "test_bench.py",  # 37
    "test_distributed_utils.py",  # 35
    "test_gate.py",  # 31
    "test_run_end_to_end.py",  # 29
    "test_causes.py",  # 28
    "test_zoo.py",  # 27
    "test_scale.py",  # 27
    "test_model_utils.py",  # 21
    "test_moe.py",  # 20
    "test_external_suites.py",  # 18
    "test_model_suite.py",  # 18
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # stable: a file's tests keep their order


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
