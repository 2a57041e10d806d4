"""Bug: the ring attention applies the causal mask only inside a chunk; every other chunk pair,
future ones included, is treated as fully visible."""

import importlib.util
from pathlib import Path

# A private copy of the real module: its functions look module-level names up at call time, so what
# is patched below changes what they do, without touching distributed_impl.cp_utils itself.
_spec = importlib.util.spec_from_file_location(
    "_cp_utils_ring_no_causal_between_blocks", Path(__file__).resolve().parents[3] / "distributed_impl" / "cp_utils.py")
_m = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_m)

_m._chunk_visibility = lambda q_chunk, k_chunk: "causal" if q_chunk == k_chunk else "full"

_build_position_ids = _m._build_position_ids
get_train_context = _m.get_train_context
create_context_parallel_ctx = _m.create_context_parallel_ctx
make_cp_batch_and_ctx = _m.make_cp_batch_and_ctx
make_cp_batch_for_te = _m.make_cp_batch_for_te
_shard_thd_chunk_for_te = _m._shard_thd_chunk_for_te
