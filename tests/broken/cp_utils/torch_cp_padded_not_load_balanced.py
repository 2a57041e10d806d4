"""Bug (in the torch-CP implementation of tests/impls): a batch it had to pad is sharded without load
balancing.  It turns torch's `enable_load_balance` flag off for padded batches (as if head-tail needed
the unpadded length to divide by 2·CP), and torch 2.13 then shards every buffer in contiguous chunks
without a word: rank 0 holds positions 0-5 of 12 instead of 0-2 and 9-11.  Attention stays exact
(torch's ring handles contiguous chunks too), so only the layout is wrong: a silent wrong answer."""

import contextlib
import sys
from pathlib import Path

from torch.distributed.tensor.experimental._context_parallel._attention import _cp_options

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402

HONEST = Path(__file__).resolve().parents[2] / "impls" / "torch_cp_cp_utils.py"
_honest: dict = {}
export_real_module(_honest, "cp_utils", source=HONEST)  # the correct code the replacement below calls


def make_cp_batch_and_ctx(device_mesh, batch, loss_mask=None, use_te: bool = False, padding_token_id: int = 0,
                          num_chunks: int = 1, seq_lens_padding_value: int = -1000):
    tokens = batch.get("input_ids") if batch.get("input_ids") is not None else batch.get("inputs_embeds")
    cp = device_mesh["cp"].size() if device_mesh is not None and "cp" in (device_mesh.mesh_dim_names or ()) else 1
    load_balance = tokens is None or tokens.shape[1] % (2 * cp) == 0  # the bug: decided before padding
    train_ctx, batch = _honest["make_cp_batch_and_ctx"](device_mesh, batch, loss_mask, use_te, padding_token_id, num_chunks,
                                                seq_lens_padding_value)
    if load_balance or use_te:
        return train_ctx, batch

    @contextlib.contextmanager
    def contiguous_ctx():
        _cp_options.enable_load_balance = False
        try:
            with train_ctx():
                yield
        finally:
            _cp_options.enable_load_balance = True

    return contiguous_ctx, batch


export_real_module(globals(), "cp_utils", source=HONEST, make_cp_batch_and_ctx=make_cp_batch_and_ctx)
