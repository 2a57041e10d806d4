"""BUG: the one-chunk path (chunk_size 0) squeezes the token dim of the valid rows (meant for a stray [1, N, V]
micro-batch dim), so a rank with exactly one valid token hands the KL a [V] vector and raises IndexError.  The fixed
matrix never has a single valid token on a rank with chunk_size 0 (its single-token rank runs chunk_size 5);
`shardcheck fuzz` draws it."""

import sys
from pathlib import Path

from shardcheck.distributed_impl import kd_loss as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


def _kl_forward_tp(t_logits, s_logits, tp_group, chunk_size=0, temperature=1.0, fp32_upcast=True):
    if chunk_size == 0:
        t_logits, s_logits = t_logits.squeeze(0), s_logits.squeeze(0)
    return good._kl_forward_tp(t_logits, s_logits, tp_group, chunk_size, temperature, fp32_upcast)


def _kl_forward_chunked(t_logits, s_logits, chunk_size, temperature=1.0, fp32_upcast=True):
    if chunk_size == 0:
        t_logits, s_logits = t_logits.squeeze(0), s_logits.squeeze(0)
    return good._kl_forward_chunked(t_logits, s_logits, chunk_size, temperature, fp32_upcast)


export_real_module(globals(), "kd_loss", _kl_forward_tp=_kl_forward_tp, _kl_forward_chunked=_kl_forward_chunked)
