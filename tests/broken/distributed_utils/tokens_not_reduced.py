"""BUG: reduce_loss sums the loss over DP but returns this rank's token count as the denominator."""

import sys
from pathlib import Path

import torch.distributed as dist

from shardcheck.distributed_impl import distributed_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


def reduce_loss(loss_store, total_num_tokens, per_token_loss=True, dp_group=None):
    loss, denominator = good.reduce_loss(loss_store, total_num_tokens, per_token_loss, dp_group=None)
    if dp_group is not None:
        dist.all_reduce(loss, group=dp_group)  # the denominator stays local
    return loss, denominator


export_real_module(globals(), "distributed_utils", reduce_loss=reduce_loss)
