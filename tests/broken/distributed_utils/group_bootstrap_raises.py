"""BUG (an early upstream FirstRankPerNode): with no process group it bootstraps one it cannot create: in a job's
environment `new_group` before any default group exists (a ValueError on every rank), and in a single process without
that environment `init_process_group` from env:// (a ValueError: MASTER_ADDR expected).  Two raises, two messages, two
lines of the findings; the cases where a process group already exists are unaffected."""

import os
import sys
from pathlib import Path

import torch.distributed as dist

from shardcheck.distributed_impl import distributed_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402

JOB_ENV = ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")


class FirstRankPerNode(good.FirstRankPerNode):
    def __enter__(self, *args, **kwargs):
        if not dist.is_initialized():
            if all(k in os.environ for k in JOB_ENV):
                dist.new_group(backend="gloo")  # the bug: no default group to make a group of
            else:
                dist.init_process_group(backend="gloo", world_size=1, rank=0)  # the bug: env:// with no job
        return super().__enter__(*args, **kwargs)


export_real_module(globals(), "distributed_utils", FirstRankPerNode=FirstRankPerNode)
