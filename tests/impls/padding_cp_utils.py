"""An independently written cp_utils, honest, whose create_context_parallel_ctx pads a sequence 2·CP does not
divide instead of refusing it: on enter, every buffer is padded in place on the right with zeros to a multiple of
2·CP (as make_cp_batch_and_ctx pads its batch) and then sharded; on exit, restored buffers get back their
original, unpadded values.  Causal attention keeps the real tokens exact and a zero loss_mask drops the padding
from the loss: by "loud or right", shardcheck must pass it on the real tokens' loss and gradients."""

from __future__ import annotations

import sys
from pathlib import Path

from shardcheck.distributed_impl import cp_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/
from real_module import export_real_module  # noqa: E402


class _PaddedContextParallel:
    def __init__(self, cp_mesh, buffers, seq_dims, no_restore, rotate_method):
        self.args = cp_mesh, list(buffers), list(seq_dims), no_restore or set(), rotate_method
        self.inner = None
        self.originals = []

    def __enter__(self):
        cp_mesh, buffers, seq_dims, no_restore, rotate_method = self.args
        multiple = 2 * cp_mesh.size()
        self.originals = [None if any(buf is x for x in no_restore) else buf.clone() for buf in buffers]
        for buf, dim in zip(buffers, seq_dims):
            padded = good._pad_seq(buf, dim, -buf.shape[dim] % multiple, 0)
            buf.resize_(padded.shape)
            buf.copy_(padded)
        self.inner = good.create_context_parallel_ctx(cp_mesh, buffers, seq_dims, no_restore, rotate_method)
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        self.inner.__exit__(*exc)
        for buf, original in zip(self.args[1], self.originals):
            if original is not None:
                buf.resize_(original.shape)
                buf.copy_(original)
        return False


def create_context_parallel_ctx(cp_mesh, cp_buffers, cp_seq_dims, cp_no_restore_buffers, cp_rotate_method=None):
    if cp_rotate_method not in (None, "allgather", "alltoall"):
        raise ValueError(f"unknown cp_rotate_method {cp_rotate_method!r}")
    return _PaddedContextParallel(cp_mesh, cp_buffers, cp_seq_dims, cp_no_restore_buffers, cp_rotate_method)


export_real_module(globals(), "cp_utils", create_context_parallel_ctx=create_context_parallel_ctx)
