"""BUG: _barrier_with_timeout ignores its timeout (a plain barrier): the ranks that arrived wait for
the late one for as long as it takes; a rank that waits for them in turn deadlocks the job."""

import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


def _barrier_with_timeout(timeout: timedelta, group=None) -> bool:
    dist.barrier(group=group)
    return True


export_real_module(globals(), "distributed_utils", _barrier_with_timeout=_barrier_with_timeout)
