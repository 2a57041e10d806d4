"""Bug: make_cp_batch_and_ctx keeps attention_mask in the batch (unsharded: the model then asks
for a masked, non-causal attention)."""

import sys
from pathlib import Path

from shardcheck.distributed_impl import cp_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


def make_cp_batch_and_ctx(device_mesh, batch, *args, **kwargs):
    mask = batch.get("attention_mask")
    ctx, out = good.make_cp_batch_and_ctx(device_mesh, batch, *args, **kwargs)
    if mask is not None:
        out["attention_mask"] = mask
    return ctx, out


export_real_module(globals(), "cp_utils", make_cp_batch_and_ctx=make_cp_batch_and_ctx)
