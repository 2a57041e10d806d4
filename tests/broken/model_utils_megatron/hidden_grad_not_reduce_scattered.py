"""BUG: the fused path's hidden-state gradient is this rank's slice of its *own* partial gradient: it is not
reduce-scattered (summed over the TP ranks, each of which used the whole gathered sequence)."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardcheck.distributed_impl import model_utils as good
from shardcheck.distributed_impl.model_utils import (_all_gather_seq, _check_saved, _chunks, _compute_distributed_softmax,
                                          _compute_dtype, _gather_logprob_grad, _hidden_chunk_logits)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _fusion_with, beside this module
from _fusion_with import make  # noqa: E402
from real_module import export_real_module  # noqa: E402


class _NoReduceScatter(good.ChunkedDistributedHiddenStatesToLogprobs):
    @staticmethod
    def backward(ctx, *grad_outputs):
        _check_saved(ctx)
        hidden, weight, target, valid = ctx.saved_tensors
        full = _all_gather_seq(hidden, ctx.tp_group)
        S, B, H = full.shape
        compute = _compute_dtype(hidden.dtype)
        grad_full = torch.empty(S, B, H, dtype=compute, device=hidden.device)
        grad_weight = torch.zeros(weight.shape, dtype=compute, device=weight.device)
        for s0, s1 in _chunks(S, ctx.chunk_size):
            softmax = _compute_distributed_softmax(_hidden_chunk_logits(full[s0:s1], weight), ctx.tp_group)
            grad_logits = _gather_logprob_grad(softmax, target[:, s0:s1, None], valid[:, s0:s1, None],
                                               grad_outputs[0][:, s0:s1, None], ctx.vocab_start_index)
            grad_full[s0:s1] = torch.matmul(grad_logits, weight.to(compute)).transpose(0, 1)
            grad_weight += grad_logits.reshape(-1, weight.shape[0]).t() @ full[s0:s1].transpose(0, 1).to(compute).reshape(-1, H)
        rank, n = dist.get_rank(ctx.tp_group), S // dist.get_world_size(ctx.tp_group)
        grad_hidden = grad_full[rank * n:(rank + 1) * n]  # the bug: no sum over the TP ranks
        return grad_hidden.to(hidden.dtype), None, grad_weight.to(weight.dtype), None, None, None, None, None


def _logprobs(hidden, output_weight_layer, output_weight, runtime_gather_output, target, vocab_start_index,
              vocab_end_index, tp_group, inference_only=False, cp_group=None, chunk_size=None):
    weight = output_weight if output_weight is not None else output_weight_layer.weight
    logprobs = _NoReduceScatter.apply(hidden, target.roll(-1, dims=-1), weight, vocab_start_index, vocab_end_index,
                                      chunk_size, tp_group, inference_only)
    return logprobs[:, :-1].contiguous()


patch_gpt_model_forward_for_linear_ce_fusion, _gpt_forward_with_linear_ce_fusion = make(_logprobs)

export_real_module(globals(), "model_utils",
                   patch_gpt_model_forward_for_linear_ce_fusion=patch_gpt_model_forward_for_linear_ce_fusion,
                   _gpt_forward_with_linear_ce_fusion=_gpt_forward_with_linear_ce_fusion)
