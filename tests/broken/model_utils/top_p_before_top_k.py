"""BUG: top-p filters the full distribution *before* top-k (instead of the top-k-renormalised one after it)."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardcheck.distributed_impl import model_utils as good
from shardcheck.distributed_impl.model_utils import _check_ids, _check_logits, _gather_chunk_rows, _upcast, _vp2sq

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


def _top_p_then_top_k(x, top_k, top_p):
    dropped = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(torch.softmax(x, dim=-1), dim=-1, stable=True)
        drop_sorted = sorted_probs.cumsum(-1) <= 1.0 - top_p
        drop_sorted[..., -1] = False
        dropped = dropped | drop_sorted.scatter(-1, order, drop_sorted)
        x = x.masked_fill(dropped, float("-inf"))
    if top_k is not None and 0 < top_k < x.shape[-1]:
        dropped = dropped | (x < torch.topk(x, top_k, dim=-1).values[..., -1:])
        x = x.masked_fill(dropped, float("-inf"))
    return x, dropped


class DistributedLogprobWithSampling(good.DistributedLogprobWithSampling):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, tp_group, top_k, top_p, inference_only=False):
        _check_logits("vocab_parallel_logits", vocab_parallel_logits)
        _check_ids("target", target, vocab_parallel_logits.shape[:2])
        B, S, V_local = vocab_parallel_logits.shape
        rank, world = dist.get_rank(tp_group), dist.get_world_size(tp_group)
        if (B * S) % world:
            raise ValueError(f"B*S={B * S} is not divisible by TP={world}")
        m = B * S // world
        x = _upcast(_vp2sq(vocab_parallel_logits.reshape(B * S, V_local), tp_group))
        t = target.reshape(B * S).long()[rank * m:(rank + 1) * m]
        filtered, dropped = _top_p_then_top_k(x, top_k, top_p)
        log_probs = torch.log_softmax(filtered, dim=-1)
        V = x.shape[-1]
        valid = (t >= 0) & (t < V)
        tc = t.clamp(0, V - 1).unsqueeze(-1)
        lp = torch.where(valid, log_probs.gather(-1, tc).squeeze(-1), torch.zeros((), dtype=log_probs.dtype))
        chosen = valid & ~dropped.gather(-1, tc).squeeze(-1)
        out = _gather_chunk_rows([lp], tp_group).view(B, S)
        ctx.inference_only, ctx.chunked = inference_only, False
        ctx.tp_group, ctx.top_k, ctx.top_p, ctx.temperature = tp_group, top_k, top_p, 1.0
        ctx.rows_per_chunk, ctx.input_dtype, ctx.shape = B * S, vocab_parallel_logits.dtype, (B, S, V_local)
        if not inference_only:
            ctx.save_for_backward(log_probs.exp(), t, chosen, valid)
        return out


export_real_module(globals(), "model_utils", DistributedLogprobWithSampling=DistributedLogprobWithSampling)
