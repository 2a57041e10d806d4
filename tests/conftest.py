"""pytest fixtures; what tests share otherwise is in helpers.py."""

from __future__ import annotations

import pytest
from helpers import BROKEN, FIXTURES, Run, assert_one_cause, shardcheck


@pytest.fixture
def run_shardcheck(tmp_path):
    counter = iter(range(1000))

    def _run(*args: str, timeout: float = 600, strict: bool = True, fresh: bool = False) -> Run:
        run = shardcheck(*args, out=tmp_path / f"run{next(counter)}", timeout=timeout, strict=strict, fresh=fresh)
        if any(str(BROKEN) in a or str(FIXTURES) in a for a in args):  # exactly one cause per broken op
            assert_one_cause(run)
        return run

    return _run
