"""BUG: FirstRankPerNode keys "first" on the global rank: only rank 0 of the job runs first; the
first rank of every other node waits like any other rank and gets False."""

import os
import sys
from pathlib import Path

import torch.distributed as dist

from shardcheck.distributed_impl import distributed_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


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


export_real_module(globals(), "distributed_utils", FirstRankPerNode=FirstRankPerNode)
