"""Bug: the THD padding mask is input_ids == padding_token_id (real tokens that share the pad id
are masked, as upstream once did)."""

import importlib.util
from pathlib import Path

# A private copy of the real module: its functions look module-level names up at call time, so what
# is patched below changes what they do, without touching distributed_impl.cp_utils itself.
_spec = importlib.util.spec_from_file_location(
    "_cp_utils_thd_mask_by_token_id", Path(__file__).resolve().parents[3] / "distributed_impl" / "cp_utils.py")
_m = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_m)

_real_to_thd = _m._to_thd


def _to_thd_mask_by_id(batch, padding_token_id, seq_lens_padding_value):
    thd = _real_to_thd(batch, padding_token_id, seq_lens_padding_value)
    ids = thd["input_ids"]
    thd["padding_mask"] = ids == padding_token_id if ids.dim() == 1 else (ids == padding_token_id).all(-1)
    return thd


_m._to_thd = _to_thd_mask_by_id

_build_position_ids = _m._build_position_ids
get_train_context = _m.get_train_context
create_context_parallel_ctx = _m.create_context_parallel_ctx
make_cp_batch_and_ctx = _m.make_cp_batch_and_ctx
make_cp_batch_for_te = _m.make_cp_batch_for_te
_shard_thd_chunk_for_te = _m._shard_thd_chunk_for_te
