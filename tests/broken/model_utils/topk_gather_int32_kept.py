"""BUG (NeMo-RL's top-k gather before its `.long()`): the backward of ChunkedDistributedGatherLogprob maps the global
ids to local ones in the ids' own dtype and hands them to an op that takes int64 indices only (here one_hot; upstream
it was torch.gather, which accepts int32 since torch 2.8): int32 ids, as an inference engine returns top-k ids, raise.
`make(long_ids=True)` is the fixed version (tests/broken/model_utils/topk_gather_int32_long.py)."""

import sys
from pathlib import Path

import torch

from shardcheck.distributed_impl import model_utils as good
from shardcheck.distributed_impl.model_utils import _chunks, _compute_distributed_softmax

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from real_module import export_real_module  # noqa: E402


def make(long_ids: bool) -> type:
    """Our ChunkedDistributedGatherLogprob with a one-hot backward on local ids, taken `.long()` or not."""

    class ChunkedDistributedGatherLogprob(good.ChunkedDistributedGatherLogprob):
        @staticmethod
        def forward(
            ctx,
            vocab_parallel_logits,
            global_indices,
            vocab_start_index,
            vocab_end_index,
            chunk_size,
            tp_group,
            inference_only=False,
        ):
            ctx.ids_dtype = global_indices.dtype  # the forward saves int64 copies: keep the caller's dtype
            return good.ChunkedDistributedGatherLogprob.forward(
                ctx,
                vocab_parallel_logits,
                global_indices,
                vocab_start_index,
                vocab_end_index,
                chunk_size,
                tp_group,
                inference_only,
            )

        @staticmethod
        def backward(ctx, *grad_outputs):
            logits, ids, valid = ctx.saved_tensors
            ids, start, v_local = ids.to(ctx.ids_dtype), ctx.vocab_start_index, logits.shape[-1]
            grad_input = torch.empty_like(logits)
            for s0, s1 in _chunks(logits.shape[1], ctx.chunk_size):
                softmax = _compute_distributed_softmax(logits[:, s0:s1], ctx.tp_group)
                g = torch.where(valid[:, s0:s1], grad_outputs[0][:, s0:s1].to(softmax.dtype), 0.0)
                idx = ids[:, s0:s1]
                owned = (idx >= start) & (idx < start + v_local)
                local = (idx - start).clamp(0, max(v_local - 1, 0))
                hot = torch.nn.functional.one_hot(local.long() if long_ids else local, v_local)  # [B, Sc, K, V]
                picked = (hot.to(softmax.dtype) * torch.where(owned, g, 0.0)[..., None]).sum(-2)
                grad_input[:, s0:s1] = softmax * -g.sum(-1, keepdim=True) + picked
            return grad_input, None, None, None, None, None, None

    return ChunkedDistributedGatherLogprob


export_real_module(globals(), "model_utils", ChunkedDistributedGatherLogprob=make(long_ids=False))
