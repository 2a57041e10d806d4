"""Bug: the THD padding mask is input_ids == padding_token_id (real tokens that share the pad id
are masked, as upstream once did)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _private_copy import private_copy, seed_api  # noqa: E402

_m = private_copy(__file__)  # patched below

_real_to_thd = _m._to_thd


def _to_thd_mask_by_id(batch, padding_token_id, seq_lens_padding_value):
    thd = _real_to_thd(batch, padding_token_id, seq_lens_padding_value)
    ids = thd["input_ids"]
    thd["padding_mask"] = ids == padding_token_id if ids.dim() == 1 else (ids == padding_token_id).all(-1)
    return thd


_m._to_thd = _to_thd_mask_by_id

globals().update(seed_api(_m))  # the six seed names, as patched
