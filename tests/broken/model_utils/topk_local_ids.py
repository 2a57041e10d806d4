"""BUG: distributed_vocab_topk reports each candidate's id in its rank's *local* numbering, not the global one."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardcheck.distributed_impl.model_utils import _chunks, _upcast

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


@torch.no_grad()
def distributed_vocab_topk(vocab_parallel_logits, k, tp_group, *, vocab_start_index, vocab_end_index, chunk_size=None):
    B, S, V_local = vocab_parallel_logits.shape
    world = dist.get_world_size(tp_group)
    k_local = min(k, V_local)
    vals, ids = [], []
    for s0, s1 in _chunks(S, S if chunk_size is None else chunk_size):
        v, i = torch.topk(_upcast(vocab_parallel_logits[:, s0:s1]), k_local, dim=-1)
        v = torch.nn.functional.pad(v, (0, k - k_local), value=float("-inf")).contiguous()
        i = torch.nn.functional.pad(i, (0, k - k_local), value=-1).contiguous()  # the bug: no + vocab_start_index
        all_v = torch.empty(world * v.numel(), dtype=v.dtype)
        all_i = torch.empty(world * i.numel(), dtype=i.dtype)
        dist.all_gather_into_tensor(all_v, v.view(-1), group=tp_group)
        dist.all_gather_into_tensor(all_i, i.view(-1), group=tp_group)
        all_v = all_v.view(world, B, s1 - s0, k).permute(1, 2, 0, 3).reshape(B, s1 - s0, world * k)
        all_i = all_i.view(world, B, s1 - s0, k).permute(1, 2, 0, 3).reshape(B, s1 - s0, world * k)
        real_first = torch.argsort((all_i < 0).to(torch.uint8), dim=-1, stable=True)
        all_v, all_i = all_v.gather(-1, real_first), all_i.gather(-1, real_first)
        top_v, pos = torch.sort(all_v, dim=-1, descending=True, stable=True)
        vals.append(top_v[..., :k])
        ids.append(all_i.gather(-1, pos[..., :k]))
    return torch.cat(vals, dim=1), torch.cat(ids, dim=1)


export_real_module(globals(), "model_utils", distributed_vocab_topk=distributed_vocab_topk)
