"""BUG: _barrier_with_timeout runs a gloo monitored_barrier on the group it is given (the default group
when none is): it returns False on time, but a gloo timeout closes that group's connections, so
the group fails from then on."""

import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


def _barrier_with_timeout(timeout: timedelta, group=None) -> bool:
    try:
        dist.monitored_barrier(group=group, timeout=timeout)
        return True
    except RuntimeError:
        return False


export_real_module(globals(), "distributed_utils", _barrier_with_timeout=_barrier_with_timeout)
