"""BUG (a historical FirstRankPerNode): an exception in the block on rank 0 ends the job with `quit(1)`, which swallows
it: the job exits 1 with no trace of what failed or where.  Any other rank's exception propagates as it should, so
only a case raising on rank 0 shows it."""

import sys
from pathlib import Path

import torch.distributed as dist

from shardcheck.distributed_impl import distributed_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


class FirstRankPerNode(good.FirstRankPerNode):
    def __exit__(self, exc_type, exc_val, exc_tb):
        if exc_type is not None and dist.is_initialized() and dist.get_rank() == 0:
            quit(1)  # the bug: the exception is lost
        return super().__exit__(exc_type, exc_val, exc_tb)


export_real_module(globals(), "distributed_utils", FirstRankPerNode=FirstRankPerNode)
