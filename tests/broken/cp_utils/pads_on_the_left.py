"""BUG (bad input, silent wrong answer): create_context_parallel_ctx pads a sequence 2·CP does not divide, as it
may, but on the *left*: under causal attention every real token now attends to the padding, so the loss and
every gradient of the real tokens are wrong."""

import sys
from pathlib import Path

import torch

from shardcheck.distributed_impl import cp_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


class _LeftPaddedContextParallel:
    def __init__(self, cp_mesh, buffers, seq_dims, no_restore, rotate_method):
        self.args = cp_mesh, list(buffers), list(seq_dims), no_restore or set(), rotate_method

    def __enter__(self):
        cp_mesh, buffers, seq_dims, no_restore, rotate_method = self.args
        for buf, dim in zip(buffers, seq_dims):
            pad = -buf.shape[dim] % (2 * cp_mesh.size())
            padded = torch.cat([torch.zeros_like(buf.narrow(dim, 0, pad)), buf], dim)
            buf.resize_(padded.shape)
            buf.copy_(padded)
        self.inner = good.create_context_parallel_ctx(cp_mesh, buffers, seq_dims, no_restore, rotate_method)
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)


def create_context_parallel_ctx(cp_mesh, cp_buffers, cp_seq_dims, cp_no_restore_buffers, cp_rotate_method=None):
    return _LeftPaddedContextParallel(cp_mesh, cp_buffers, cp_seq_dims, cp_no_restore_buffers, cp_rotate_method)


export_real_module(globals(), "cp_utils", create_context_parallel_ctx=create_context_parallel_ctx)
