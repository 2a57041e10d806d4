"""Bug: preserve_grad=False detaches the whole gather, the local slice included, so not even this
rank's own loss reaches its passages (the documented local-only gradient is lost)."""

import sys
from pathlib import Path

from shardcheck.distributed_impl import inbatch_neg_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


def _gather(t, preserve_grad=False):
    if preserve_grad and t.requires_grad:
        return good._all_gather_tensor(t, preserve_grad=True)
    return good._all_gather_tensor(t.detach())


def dist_gather_tensor(t, preserve_grad=False):
    if t is None or t.ndim == 0 or not good._gathering():  # None, bad shapes, a world of 1: as the correct one
        return good.dist_gather_tensor(t, preserve_grad)
    return _gather(t, preserve_grad)


export_real_module(globals(), "inbatch_neg_utils", dist_gather_tensor=dist_gather_tensor)
