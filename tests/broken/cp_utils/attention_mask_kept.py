"""Bug: make_cp_batch_and_ctx keeps attention_mask in the batch (unsharded: the model then asks
for a masked, non-causal attention)."""

import importlib.util
from pathlib import Path

# A private copy of the real module: its functions look module-level names up at call time, so what
# is patched below changes what they do, without touching distributed_impl.cp_utils itself.
_spec = importlib.util.spec_from_file_location(
    "_cp_utils_attention_mask_kept", Path(__file__).resolve().parents[3] / "distributed_impl" / "cp_utils.py")
_m = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_m)

_real_make = _m.make_cp_batch_and_ctx


def _make_keeping_mask(device_mesh, batch, *args, **kwargs):
    mask = batch.get("attention_mask")
    ctx, out = _real_make(device_mesh, batch, *args, **kwargs)
    if mask is not None:
        out["attention_mask"] = mask
    return ctx, out


_m.make_cp_batch_and_ctx = _make_keeping_mask

_build_position_ids = _m._build_position_ids
get_train_context = _m.get_train_context
create_context_parallel_ctx = _m.create_context_parallel_ctx
make_cp_batch_and_ctx = _m.make_cp_batch_and_ctx
make_cp_batch_for_te = _m.make_cp_batch_for_te
_shard_thd_chunk_for_te = _m._shard_thd_chunk_for_te
