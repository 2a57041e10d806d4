"""BUG: _barrier_with_timeout ignores `group` and waits for every rank of the world (as a historical upstream
version did, barriering a new gloo group over all ranks): when only a group's members call it, they wait for ranks
that never come and get False (the pre-fix side of tests/test_prefix_pair.py's sub-group pair)."""

import sys
from datetime import timedelta
from pathlib import Path

from shardcheck.distributed_impl import distributed_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


def _barrier_with_timeout(timeout: timedelta, group=None) -> bool:
    return good._barrier_with_timeout(timeout)  # the world's barrier, whatever group was asked for


export_real_module(globals(), "distributed_utils", _barrier_with_timeout=_barrier_with_timeout)
