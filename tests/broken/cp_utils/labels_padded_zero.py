"""Bug: the batch is padded to a multiple of 2·CP with label 0 instead of -100 (padded tokens enter the loss)."""

import importlib.util
from pathlib import Path

# A private copy of the real module: its functions look module-level names up at call time, so what
# is patched below changes what they do, without touching distributed_impl.cp_utils itself.
_spec = importlib.util.spec_from_file_location(
    "_cp_utils_labels_padded_zero", Path(__file__).resolve().parents[3] / "distributed_impl" / "cp_utils.py")
_m = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_m)

_m.PAD_FILLS = {**_m.PAD_FILLS, "labels": 0}

_build_position_ids = _m._build_position_ids
get_train_context = _m.get_train_context
create_context_parallel_ctx = _m.create_context_parallel_ctx
make_cp_batch_and_ctx = _m.make_cp_batch_and_ctx
make_cp_batch_for_te = _m.make_cp_batch_for_te
_shard_thd_chunk_for_te = _m._shard_thd_chunk_for_te
