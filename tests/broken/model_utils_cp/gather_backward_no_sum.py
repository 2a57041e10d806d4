"""BUG: the CP all-gather's backward keeps this rank's own upstream gradient at its positions instead of
the sum over every CP rank's upstream gradient (each rank's use of the gathered tensor is a summand)."""

from distributed_impl.model_utils import *  # noqa: F401,F403  everything else is the real implementation
from distributed_impl.model_utils import _get_tokens_on_this_cp_rank  # noqa: F401  (not in import *)
import torch.distributed as dist

from distributed_impl import model_utils as good


class AllGatherCPTensor(good.AllGatherCPTensor):
    @staticmethod
    def backward(ctx, *grad_outputs):
        mine = ctx.positions[dist.get_rank(ctx.cp_group)]
        return grad_outputs[0].index_select(ctx.seq_dim, mine.to(grad_outputs[0].device)).clone(), None, None


def allgather_cp_sharded_tensor(tensor, cp_group, seq_dim=1):
    return AllGatherCPTensor.apply(tensor, cp_group, seq_dim)
