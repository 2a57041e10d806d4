"""BUG: _barrier_with_timeout ignores `group` and waits for every rank of the world (as a historical upstream
version did, barriering a new gloo group over all ranks): when only a group's members call it, they wait for ranks
that never come and get False.  It also keeps barrier_short_timeout_true.py's defect (True on a short timeout), a
second scenario's bug: the pair's pre-fix side."""

import sys
from datetime import timedelta
from pathlib import Path

from shardcheck.distributed_impl import distributed_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402

SHORT_S = 2.0


def _barrier_with_timeout(timeout: timedelta, group=None) -> bool:
    arrived = good._barrier_with_timeout(timeout)  # the world's barrier, whatever group was asked for
    return True if timeout.total_seconds() < SHORT_S else arrived


export_real_module(globals(), "distributed_utils", _barrier_with_timeout=_barrier_with_timeout)
