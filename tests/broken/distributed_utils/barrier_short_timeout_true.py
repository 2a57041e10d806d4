"""BUG: _barrier_with_timeout returns True whatever happened when its timeout is under 2 s (a short barrier taken as
"best effort"): the ranks that waited for a late rank, and the late rank, get True.  The fixed side of
tests/test_prefix_pair.py's sub-group pair (barrier_ignores_group.py adds the sub-group defect to this one)."""

import sys
from datetime import timedelta
from pathlib import Path

from shardcheck.distributed_impl import distributed_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402

SHORT_S = 2.0


def _barrier_with_timeout(timeout: timedelta, group=None) -> bool:
    arrived = good._barrier_with_timeout(timeout, group)
    return True if timeout.total_seconds() < SHORT_S else arrived


export_real_module(globals(), "distributed_utils", _barrier_with_timeout=_barrier_with_timeout)
