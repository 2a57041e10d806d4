"""BUG: the CP all-gather's backward keeps this rank's own upstream gradient at its positions instead of
the sum over every CP rank's upstream gradient (each rank's use of the gathered tensor is a summand)."""

import sys
from pathlib import Path

import torch.distributed as dist

from shardcheck.distributed_impl import model_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


class AllGatherCPTensor(good.AllGatherCPTensor):
    @staticmethod
    def backward(ctx, *grad_outputs):
        mine = ctx.positions[dist.get_rank(ctx.cp_group)]
        return grad_outputs[0].index_select(ctx.seq_dim, mine.to(grad_outputs[0].device)).clone(), None, None


def allgather_cp_sharded_tensor(tensor, cp_group, seq_dim=1):
    return AllGatherCPTensor.apply(tensor, cp_group, seq_dim)


export_real_module(globals(), "model_utils", AllGatherCPTensor=AllGatherCPTensor,
                   allgather_cp_sharded_tensor=allgather_cp_sharded_tensor)
