"""BUG: the log-softmax shifts by the *local* max (the MAX all-reduce is missing), so the
summed exponentials of different ranks are on different scales."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


@torch.no_grad()
def _compute_distributed_log_softmax(vocab_parallel_logits, group):
    x = vocab_parallel_logits.to(torch.promote_types(vocab_parallel_logits.dtype, torch.float32))
    x = x - x.amax(dim=-1, keepdim=True)
    sum_exp = x.exp().sum(-1, keepdim=True)
    dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=group)
    return x - sum_exp.log()


export_real_module(globals(), "model_utils", _compute_distributed_log_softmax=_compute_distributed_log_softmax)
