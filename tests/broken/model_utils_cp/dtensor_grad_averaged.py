"""BUG: the DTensor front ends' CP gather backs the mean of the CP ranks' upstream gradients (a sum divided by the CP
size, as if the result were Partial("avg")): neither the sum of every rank's upstream gradient nor each rank's own."""

import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402

from shardcheck.distributed_impl import model_utils as good  # noqa: E402

_IMPLS = Path(__file__).resolve().parents[2] / "impls"


def _sum_grads_at_positions(grad, group, seq_dim, positions):
    return good._sum_grads_at_positions(grad, group, seq_dim, positions) / dist.get_world_size(group)


class _GatherMean(good._GatherCPPositions):
    @staticmethod
    def backward(ctx, grad):
        return _sum_grads_at_positions(grad, ctx.cp_group, ctx.seq_dim, ctx.positions), None, None, None


def _full_tensor_over_cp(local, cp_group, positions):
    if positions.shape[0] == 1:
        return local
    return _GatherMean.apply(local, cp_group, 1, positions)


export_real_module(
    globals(),
    "model_utils",
    _IMPLS / "dtensor_own_grad_model_utils.py",
    _full_tensor_over_cp=_full_tensor_over_cp,
)
