"""BUG (upstream's get_sync_ctx before NVIDIA-NeMo/Automodel 147726c): only a DistributedDataParallel instance gets
`no_sync()`; any other wrapper that has one (Megatron-FSDP's) gets a null context and syncs on every micro-batch
(right values, the gradient traffic of every micro-batch)."""

import sys
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.distributed.fsdp import FSDPModule

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


def get_sync_ctx(model, is_optim_step, defer_fsdp_grad_sync):
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(is_optim_step if defer_fsdp_grad_sync else True)
    elif isinstance(model, torch.nn.parallel.DistributedDataParallel) and not is_optim_step:
        return model.no_sync()
    return nullcontext()


export_real_module(globals(), "distributed_utils", get_sync_ctx=get_sync_ctx)
