"""Bug: dim 1 is padded with zeros whatever padding_value says."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardcheck.distributed_impl import inbatch_neg_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


def dist_gather_tensor_with_dim1_padding(t, padding_value=0, preserve_grad=False):
    if t is None or t.ndim < 2 or not good._gathering():
        return good.dist_gather_tensor_with_dim1_padding(t, padding_value, preserve_grad)
    longest = torch.tensor([t.shape[1]], dtype=torch.int64, device=t.device)
    dist.all_reduce(longest, op=dist.ReduceOp.MAX)
    padded = F.pad(t, (0, 0) * (t.ndim - 2) + (0, int(longest) - t.shape[1]))  # value 0, not padding_value
    return good._all_gather_tensor(padded, preserve_grad)


export_real_module(globals(), "inbatch_neg_utils",
                   dist_gather_tensor_with_dim1_padding=dist_gather_tensor_with_dim1_padding)
