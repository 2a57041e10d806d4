"""BUG: _barrier_with_timeout lets monitored_barrier's timeout error escape instead of returning False."""

from datetime import timedelta

import torch.distributed as dist

from distributed_impl.distributed_utils import *  # noqa: F401,F403  everything else is the real implementation
from distributed_impl.distributed_utils import _create_gloo_group  # noqa: F401  (private names: not in *)


def _barrier_with_timeout(timeout: timedelta, group=None) -> bool:
    dist.monitored_barrier(group=group, timeout=timeout)
    return True
