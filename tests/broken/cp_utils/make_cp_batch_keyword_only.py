"""Drifted signatures, right values: `make_cp_batch_and_ctx` takes everything after `batch` by keyword only (the
seed takes `loss_mask`, `use_te`, ... by position too), and `make_cp_batch_for_te`, which the built-in model
suite's step never calls, takes `batch` and `cp_mesh` the other way round.  Called by the seed's parameter names
(as the harness calls someone else's module), the step runs and every value is right: the model suite's one
finding is the signature of the function its step calls, `cp_utils.make_cp_batch_and_ctx`, not the other's."""

import sys
from pathlib import Path

from shardcheck.distributed_impl import cp_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


def make_cp_batch_and_ctx(device_mesh, batch, *, loss_mask=None, use_te: bool = False, padding_token_id: int = 0,
                          num_chunks: int = 1, seq_lens_padding_value: int = -1000):
    return good.make_cp_batch_and_ctx(device_mesh, batch, loss_mask, use_te, padding_token_id, num_chunks,
                                      seq_lens_padding_value)


def make_cp_batch_for_te(batch, cp_mesh, qkv_format="thd", padding_token_id: int = 0, num_chunks: int = 1,
                         seq_lens_padding_value: int = -1000):
    return good.make_cp_batch_for_te(cp_mesh, batch, qkv_format, padding_token_id, num_chunks, seq_lens_padding_value)


export_real_module(globals(), "cp_utils")
