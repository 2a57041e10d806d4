"""Bug: with per_token_loss=False the denominator summed over DP is this rank's loss count times the DP size, as if
every DP rank held as many micro-batch losses as this one.  Right whenever DP divides the losses evenly (the fixed
matrix: 8 losses), wrong once the ranks hold different counts (7 losses over 2 ranks: 4 + 3)."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardcheck.distributed_impl import distributed_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


def reduce_loss(loss_store, total_num_tokens, per_token_loss=True, dp_group=None):
    loss, denominator = good.reduce_loss(loss_store, total_num_tokens, per_token_loss, dp_group)
    if not per_token_loss and dp_group is not None:
        denominator = torch.tensor([len(loss_store) * dist.get_world_size(dp_group)], dtype=torch.int64,
                                   device=denominator.device)
    return loss, denominator


export_real_module(globals(), "distributed_utils", reduce_loss=reduce_loss)
