"""An independently written inbatch_neg_utils whose dist_gather_tensor returns t unchanged at world size 1 before it
looks at t's shape, as the seed says it does ("Returns t unchanged when distributed is not available, not
initialized, or world size is 1"): a 0-d tensor comes back as it went in there, and raises at world size ≥ 2."""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

from shardcheck.distributed_impl import inbatch_neg_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/
from real_module import export_real_module  # noqa: E402


def dist_gather_tensor(t, preserve_grad: bool = False):
    if t is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return t
    return good.dist_gather_tensor(t, preserve_grad)


export_real_module(globals(), "inbatch_neg_utils", dist_gather_tensor=dist_gather_tensor)
