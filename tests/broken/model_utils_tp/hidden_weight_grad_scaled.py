"""BUG: the output-weight gradient of ChunkedDistributedHiddenStatesToLogprobs is multiplied by the TP size."""

from distributed_impl.model_utils import *  # noqa: F401,F403  everything else is the real implementation
import torch.distributed as dist

from distributed_impl import model_utils as good


class ChunkedDistributedHiddenStatesToLogprobs(good.ChunkedDistributedHiddenStatesToLogprobs):
    @staticmethod
    def backward(ctx, *grad_outputs):
        grad_hidden, grad_target, grad_weight, *rest = good.ChunkedDistributedHiddenStatesToLogprobs.backward(ctx, *grad_outputs)
        return (grad_hidden, grad_target, grad_weight * dist.get_world_size(ctx.tp_group), *rest)
