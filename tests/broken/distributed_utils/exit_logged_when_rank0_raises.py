"""The fix of quit_when_rank0_raises.py, as upstream made it: an exception in the block on rank 0 still ends that rank
with a bare SystemExit(1), but only after logging it (which rank, what failed).  The job is not aborted on the other
ranks either (the seed's "abort the entire distributed job"), which this fix kept."""

import logging
import sys
from pathlib import Path

import torch.distributed as dist

from shardcheck.distributed_impl import distributed_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402

logger = logging.getLogger(__name__)


class FirstRankPerNode(good.FirstRankPerNode):
    def __exit__(self, exc_type, exc_val, exc_tb):
        if exc_type is not None and dist.is_initialized() and dist.get_rank() == 0:
            logger.error("Exception inside FirstRankPerNode: %s: %s", exc_type.__name__, exc_val)
            raise SystemExit(1) from exc_val  # named in the log, then a bare exit
        return super().__exit__(exc_type, exc_val, exc_tb)


export_real_module(globals(), "distributed_utils", FirstRankPerNode=FirstRankPerNode)
