"""Bug: the THD padding mask is input_ids == padding_token_id (real tokens that share the pad id
are masked, as upstream once did)."""

import sys
from pathlib import Path

from shardcheck.distributed_impl import cp_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


def _to_thd(batch, padding_token_id, seq_lens_padding_value):
    thd = good._to_thd(batch, padding_token_id, seq_lens_padding_value)
    ids = thd["input_ids"]
    thd["padding_mask"] = ids == padding_token_id if ids.dim() == 1 else (ids == padding_token_id).all(-1)
    return thd


export_real_module(globals(), "cp_utils", _to_thd=_to_thd)
