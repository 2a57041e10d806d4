"""Bug: preserve_grad=True still detaches the remote slices (a plain gather with the local slice spliced
back in), so a rank's passages get the gradient of its own loss only, not of every rank's loss."""

from distributed_impl.inbatch_neg_utils import (  # noqa: F401
    _all_gather_tensor, dist_gather_tensor_with_dim1_padding, mask_gathered_passages_same_doc_as_positive)
from distributed_impl import inbatch_neg_utils as _correct


def dist_gather_tensor(t, preserve_grad=False):
    if t is None or t.ndim == 0 or not _correct._gathering():  # None, bad shapes, a world of 1: as the correct one
        return _correct.dist_gather_tensor(t, preserve_grad)
    return _correct._all_gather_tensor(t, preserve_grad=False)
