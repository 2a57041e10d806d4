"""BUG: FirstRankPerNode keys "first" on the global rank: only rank 0 of the job runs first; the
first rank of every other node waits like any other rank and gets False."""

import os

import torch.distributed as dist

from distributed_impl.distributed_utils import *  # noqa: F401,F403  everything else is the real implementation
from distributed_impl.distributed_utils import _barrier_with_timeout, _create_gloo_group  # noqa: F401  (private names: not in *)
from distributed_impl import distributed_utils as good


class FirstRankPerNode(good.FirstRankPerNode):
    def __enter__(self):
        self._created_pg = False
        self._first = True
        if not dist.is_initialized():
            if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
                return True
            dist.init_process_group(backend="gloo")
            self._created_pg = True
        self._first = dist.get_rank() == 0  # the bug: LOCAL_RANK is what says "first on its node"
        if not self._first:
            dist.barrier()
        return self._first
