"""Bug: the vocab-parallel log-softmax helper every log-prob op calls raises over more than one TP rank, so
each of those ops raises the same exception at the same line."""

import sys
from pathlib import Path

import torch.distributed as dist

from shardcheck.distributed_impl import model_utils as good

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


def _compute_distributed_log_softmax(vocab_parallel_logits, group):
    if dist.get_world_size(group) > 1:
        raise ValueError(f"log-softmax over {dist.get_world_size(group)} vocab shards of "
                         f"{vocab_parallel_logits.shape[-1]} is not supported")
    return good._compute_distributed_log_softmax(vocab_parallel_logits, group)


export_real_module(globals(), "model_utils", _compute_distributed_log_softmax=_compute_distributed_log_softmax)
