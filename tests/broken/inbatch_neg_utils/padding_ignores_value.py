"""Bug: dim 1 is padded with zeros whatever padding_value says."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from distributed_impl.inbatch_neg_utils import (  # noqa: F401
    _all_gather_tensor, dist_gather_tensor, mask_gathered_passages_same_doc_as_positive)
from distributed_impl import inbatch_neg_utils as _correct


def dist_gather_tensor_with_dim1_padding(t, padding_value=0, preserve_grad=False):
    if t is None or t.ndim < 2 or not _correct._gathering():
        return _correct.dist_gather_tensor_with_dim1_padding(t, padding_value, preserve_grad)
    longest = torch.tensor([t.shape[1]], dtype=torch.int64, device=t.device)
    dist.all_reduce(longest, op=dist.ReduceOp.MAX)
    padded = F.pad(t, (0, 0) * (t.ndim - 2) + (0, int(longest) - t.shape[1]))  # value 0, not padding_value
    return _correct._all_gather_tensor(padded, preserve_grad)
