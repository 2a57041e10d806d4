"""BUG: _barrier_with_timeout ignores its timeout (a plain barrier): the ranks that arrived wait for
the late one for as long as it takes; a rank that waits for them in turn deadlocks the job."""

from datetime import timedelta

import torch.distributed as dist

from distributed_impl.distributed_utils import *  # noqa: F401,F403  everything else is the real implementation
from distributed_impl.distributed_utils import _create_gloo_group  # noqa: F401  (private names: not in *)


def _barrier_with_timeout(timeout: timedelta, group=None) -> bool:
    dist.barrier(group=group)
    return True
