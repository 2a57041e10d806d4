"""Bug: make_cp_batch_and_ctx keeps attention_mask in the batch (unsharded: the model then asks
for a masked, non-causal attention)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _private_copy import private_copy, seed_api  # noqa: E402

_m = private_copy(__file__)  # patched below

_real_make = _m.make_cp_batch_and_ctx


def _make_keeping_mask(device_mesh, batch, *args, **kwargs):
    mask = batch.get("attention_mask")
    ctx, out = _real_make(device_mesh, batch, *args, **kwargs)
    if mask is not None:
        out["attention_mask"] = mask
    return ctx, out


_m.make_cp_batch_and_ctx = _make_keeping_mask

globals().update(seed_api(_m))  # the six seed names, as patched
