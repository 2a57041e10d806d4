"""BUG: reduce_loss sums the loss over DP but returns this rank's token count as the denominator."""

from distributed_impl.distributed_utils import *  # noqa: F401,F403  everything else is the real implementation
from distributed_impl.distributed_utils import _barrier_with_timeout, _create_gloo_group  # noqa: F401  (private names: not in *)
import torch.distributed as dist

from distributed_impl import distributed_utils as good


def reduce_loss(loss_store, total_num_tokens, per_token_loss=True, dp_group=None):
    loss, denominator = good.reduce_loss(loss_store, total_num_tokens, per_token_loss, dp_group=None)
    if dp_group is not None:
        dist.all_reduce(loss, group=dp_group)  # the denominator stays local
    return loss, denominator
