"""BUG: the output-weight gradient of ChunkedDistributedHiddenStatesToLogprobs is multiplied by the TP size."""

import sys
from pathlib import Path

import torch.distributed as dist

from shardcheck.distributed_impl import model_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


class ChunkedDistributedHiddenStatesToLogprobs(good.ChunkedDistributedHiddenStatesToLogprobs):
    @staticmethod
    def backward(ctx, *grad_outputs):
        grad_hidden, grad_target, grad_weight, *rest = good.ChunkedDistributedHiddenStatesToLogprobs.backward(ctx, *grad_outputs)
        return (grad_hidden, grad_target, grad_weight * dist.get_world_size(ctx.tp_group), *rest)


export_real_module(globals(), "model_utils",
                   ChunkedDistributedHiddenStatesToLogprobs=ChunkedDistributedHiddenStatesToLogprobs)
