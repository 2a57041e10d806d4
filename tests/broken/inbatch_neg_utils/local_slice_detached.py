"""Bug: preserve_grad=False detaches the whole gather, the local slice included, so not even this
rank's own loss reaches its passages (the documented local-only gradient is lost)."""

from distributed_impl.inbatch_neg_utils import (  # noqa: F401
    dist_gather_tensor_with_dim1_padding, mask_gathered_passages_same_doc_as_positive)
from distributed_impl import inbatch_neg_utils as _correct


def _all_gather_tensor(t, preserve_grad=False):
    if preserve_grad and t.requires_grad:
        return _correct._all_gather_tensor(t, preserve_grad=True)
    return _correct._all_gather_tensor(t.detach())


def dist_gather_tensor(t, preserve_grad=False):
    if t is None or t.ndim == 0 or not _correct._gathering():  # None, bad shapes, a world of 1: as the correct one
        return _correct.dist_gather_tensor(t, preserve_grad)
    return _all_gather_tensor(t, preserve_grad)
