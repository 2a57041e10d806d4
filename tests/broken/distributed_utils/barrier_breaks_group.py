"""BUG: _barrier_with_timeout runs a gloo monitored_barrier on the group it is given (the default group
when none is): it returns False on time, but a gloo timeout closes that group's connections, so
the group fails from then on."""

from datetime import timedelta

import torch.distributed as dist

from distributed_impl.distributed_utils import *  # noqa: F401,F403  everything else is the real implementation
from distributed_impl.distributed_utils import _create_gloo_group  # noqa: F401  (private names: not in *)


def _barrier_with_timeout(timeout: timedelta, group=None) -> bool:
    try:
        dist.monitored_barrier(group=group, timeout=timeout)
        return True
    except RuntimeError:
        return False
