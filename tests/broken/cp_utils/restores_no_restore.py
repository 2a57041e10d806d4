"""Bug: on exit every buffer is restored, those in cp_no_restore_buffers included."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _private_copy import private_copy, seed_api  # noqa: E402

_m = private_copy(__file__)  # patched below

_real_create = _m.create_context_parallel_ctx


def _create_restoring_all(cp_mesh, cp_buffers, cp_seq_dims, cp_no_restore_buffers, cp_rotate_method=None):
    return _real_create(cp_mesh, cp_buffers, cp_seq_dims, set(), cp_rotate_method)


_m.create_context_parallel_ctx = _create_restoring_all

globals().update(seed_api(_m))  # the six seed names, as patched
