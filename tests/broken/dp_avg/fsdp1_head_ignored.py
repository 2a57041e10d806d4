"""BROKEN: FSDP1 told to leave the regression head alone (`ignored_modules=[model.head]`), which then nobody
synchronizes: each DP rank steps the head with its own rows' gradient.  Named at `head.weight`, the name build()
gives, not FSDP1's `_fsdp_wrapped_module.head.weight`."""

from __future__ import annotations

import torch
from _dp_avg_plan import loss  # noqa: F401
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


def parallelize(model, ctx):
    return FullyShardedDataParallel(
        model,
        process_group=ctx.group("dp"),
        device_id=torch.device("cpu"),
        use_orig_params=True,
        auto_wrap_policy=ModuleWrapPolicy({type(model.blocks[0])}),
        ignored_modules=[model.head],
    )
