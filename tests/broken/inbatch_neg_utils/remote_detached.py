"""Bug: preserve_grad=True still detaches the remote slices (a plain gather with the local slice spliced
back in), so a rank's passages get the gradient of its own loss only, not of every rank's loss."""

import sys
from pathlib import Path

from shardcheck.distributed_impl import inbatch_neg_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


def dist_gather_tensor(t, preserve_grad=False):
    if t is None or t.ndim == 0 or not good._gathering():  # None, bad shapes, a world of 1: as the correct one
        return good.dist_gather_tensor(t, preserve_grad)
    return good._all_gather_tensor(t, preserve_grad=False)


export_real_module(globals(), "inbatch_neg_utils", dist_gather_tensor=dist_gather_tensor)
