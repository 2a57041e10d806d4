"""Bug: each CP rank's two head-tail chunks of the batch come in the wrong order (chunk 2·CP−1−r first, then r),
while the ring attention still takes the first for chunk r: every sharded buffer (input ids, position ids, labels)
holds the right tokens at the wrong places.  In the built-in model suite the first module that reads the sharded
batch (the embedding) is the first divergence."""

import sys
from pathlib import Path

import torch

from shardcheck.distributed_impl import cp_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


def _head_tail_index(length: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    head, tail = good._head_tail_index(length, cp_size, cp_rank, device).chunk(2)
    return torch.cat([tail, head])


export_real_module(globals(), "cp_utils", _head_tail_index=_head_tail_index)
