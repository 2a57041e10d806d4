"""Bug: on exit every buffer is restored, those in cp_no_restore_buffers included."""

import sys
from pathlib import Path

from shardcheck.distributed_impl import cp_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


def create_context_parallel_ctx(cp_mesh, cp_buffers, cp_seq_dims, cp_no_restore_buffers, cp_rotate_method=None):
    return good.create_context_parallel_ctx(cp_mesh, cp_buffers, cp_seq_dims, set(), cp_rotate_method)


export_real_module(globals(), "cp_utils", create_context_parallel_ctx=create_context_parallel_ctx)
