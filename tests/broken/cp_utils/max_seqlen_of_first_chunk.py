"""Bug: with num_chunks > 1, max_seqlen is the first chunk's instead of the longest over every chunk.  Right when
the first group of rows holds the longest padded sequence (the fixed matrix's chunks2 case: 16 in both groups),
wrong once a later group holds a longer one (a kernel sized by it overruns)."""

import sys
from pathlib import Path

from shardcheck.distributed_impl import cp_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


def make_cp_batch_for_te(cp_mesh, batch, qkv_format="thd", padding_token_id=0, num_chunks=1,
                         seq_lens_padding_value=-1000):
    out = good.make_cp_batch_for_te(cp_mesh, batch, qkv_format, padding_token_id, num_chunks, seq_lens_padding_value)
    if num_chunks > 1:
        per = batch["input_ids"].shape[0] // num_chunks
        first = {k: batch[k][:per] for k in ("input_ids", "labels", "seq_lens", "seq_lens_padded")}
        out["max_seqlen"] = good._to_thd(first, padding_token_id, seq_lens_padding_value)["max_seqlen"]
    return out


export_real_module(globals(), "cp_utils", make_cp_batch_for_te=make_cp_batch_for_te)
