"""BUG: get_sync_ctx always returns a null context: gradients are synchronised on every
micro-batch (right values, 3x the gradient traffic)."""

from contextlib import nullcontext

from distributed_impl.distributed_utils import *  # noqa: F401,F403  everything else is the real implementation
from distributed_impl.distributed_utils import _barrier_with_timeout, _create_gloo_group  # noqa: F401  (private names: not in *)


def get_sync_ctx(model, is_optim_step, defer_fsdp_grad_sync):
    return nullcontext()
