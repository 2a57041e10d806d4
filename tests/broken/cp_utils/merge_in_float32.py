"""Bug: the ring attention computes and merges its blocks in float32 whatever the input dtype (as
torch 2.13's own CP attention does): float64 comes back with ~1e-7 error."""

import importlib.util
from pathlib import Path

import torch

# A private copy of the real module: its functions look module-level names up at call time, so what
# is patched below changes what they do, without touching distributed_impl.cp_utils itself.
_spec = importlib.util.spec_from_file_location(
    "_cp_utils_merge_in_float32", Path(__file__).resolve().parents[3] / "distributed_impl" / "cp_utils.py")
_m = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_m)

_m._compute_dtype = lambda dtype: torch.float32

_build_position_ids = _m._build_position_ids
get_train_context = _m.get_train_context
create_context_parallel_ctx = _m.create_context_parallel_ctx
make_cp_batch_and_ctx = _m.make_cp_batch_and_ctx
make_cp_batch_for_te = _m.make_cp_batch_for_te
_shard_thd_chunk_for_te = _m._shard_thd_chunk_for_te
