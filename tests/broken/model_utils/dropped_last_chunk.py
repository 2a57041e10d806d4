"""BUG: the chunk loop only visits whole chunks, so a last partial chunk is never computed (left 0)."""

from distributed_impl.model_utils import *  # noqa: F401,F403  everything else is the real implementation
import torch

from distributed_impl import model_utils as good


def _full_chunks(S, chunk_size):
    return [(s0, s0 + chunk_size) for s0 in range(0, S - chunk_size + 1, chunk_size)]


class ChunkedDistributedLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, vocab_start_index, vocab_end_index, chunk_size, tp_group,
                inference_only=False):
        out = torch.zeros(target.shape, dtype=torch.promote_types(vocab_parallel_logits.dtype, torch.float32))
        spans = _full_chunks(target.shape[1], chunk_size)
        for s0, s1 in spans:
            out[:, s0:s1] = good.DistributedLogprob.apply(vocab_parallel_logits[:, s0:s1].detach(), target[:, s0:s1],
                                                          vocab_start_index, vocab_end_index, tp_group, True)
        ctx.save_for_backward(vocab_parallel_logits, target)
        ctx.args = (vocab_start_index, vocab_end_index, tp_group, spans)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        logits, target = ctx.saved_tensors
        vocab_start_index, vocab_end_index, tp_group, spans = ctx.args
        grad = torch.zeros_like(logits)
        for s0, s1 in spans:
            with torch.enable_grad():
                piece = logits[:, s0:s1].detach().requires_grad_()
                out = good.DistributedLogprob.apply(piece, target[:, s0:s1], vocab_start_index, vocab_end_index, tp_group)
                (g,) = torch.autograd.grad(out, piece, grad_output[:, s0:s1])
            grad[:, s0:s1] = g
        return grad, None, None, None, None, None, None
