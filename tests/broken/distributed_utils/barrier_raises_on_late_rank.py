"""BUG: _barrier_with_timeout lets monitored_barrier's timeout error escape instead of returning False."""

import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


def _barrier_with_timeout(timeout: timedelta, group=None) -> bool:
    dist.monitored_barrier(group=group, timeout=timeout)
    return True


export_real_module(globals(), "distributed_utils", _barrier_with_timeout=_barrier_with_timeout)
