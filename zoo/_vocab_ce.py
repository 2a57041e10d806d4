"""Megatron-Core's vocab-parallel cross-entropy (megatron/core/tensor_parallel/cross_entropy.py), ported: each
tensor-parallel rank holds a contiguous slice of the vocabulary of the logits; the max, the target's logit and the
sum of exponentials are all-reduced over TP, and the backward is written out (softmax minus the one-hot target),
as Megatron writes it.  What the zoo's vocabulary bugs change is a keyword each:

- `global_smoothing=False`: label smoothing with the local vocabulary size and the local mean log-probability
  (Megatron-LM#737, #7464: `vocab_size = exp_logits.size(-1)`, `log_probs.mean(dim=-1)`);
- `real_vocab`: the logits' last `V_padded - real_vocab` columns are padding (Megatron pads the vocabulary to a
  multiple of make-vocab-size-divisible-by x TP); None counts them in the softmax (Megatron-LM#1754,
  bionemo-recipes#631), a number masks them out.

And the single-device definition both are held to, `cross_entropy`."""

from __future__ import annotations

import torch
import torch.distributed as dist


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token loss [..] of logits [.., V] on one device, Megatron's smoothing: (1 - s)·nll - s·mean(log p),
    s = smoothing·V/(V - 1); a target of -100 counts for nothing (0)."""
    vocab = logits.shape[-1]
    log_p = logits - logits.logsumexp(-1, keepdim=True)
    counted = target != -100
    nll = -log_p.gather(-1, torch.where(counted, target, 0).unsqueeze(-1)).squeeze(-1)
    if label_smoothing:
        s = label_smoothing * vocab / (vocab - 1)
        nll = (1 - s) * nll - s * log_p.mean(-1)
    return torch.where(counted, nll, 0)


class VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, label_smoothing, global_smoothing, real_vocab):
        tp, rank = dist.get_world_size(group), dist.get_rank(group)
        part = logits.shape[-1]
        start = rank * part
        logits = logits.float() if logits.dtype == torch.bfloat16 else logits.clone()
        if real_vocab is not None:  # the padding columns of the last ranks out of the softmax
            padded = torch.arange(start, start + part, device=logits.device) >= real_vocab
            logits = logits.masked_fill(padded, float("-inf"))
        logits_max = logits.max(-1).values
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        logits = logits - logits_max.unsqueeze(-1)
        counted = target != -100
        mine = (target >= start) & (target < start + part) & counted
        local_target = torch.where(mine, target - start, 0)
        predicted = torch.where(mine, logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1), 0)
        dist.all_reduce(predicted, group=group)
        exp_logits = logits.exp()
        sum_exp = exp_logits.sum(-1)
        dist.all_reduce(sum_exp, group=group)
        loss = sum_exp.log() - predicted
        softmax = exp_logits / sum_exp.unsqueeze(-1)
        vocab = part * tp if global_smoothing else part
        if real_vocab is not None and global_smoothing:
            vocab = real_vocab
        if label_smoothing > 0:
            s = label_smoothing * vocab / (vocab - 1)
            log_probs = logits - sum_exp.log().unsqueeze(-1)
            if real_vocab is not None:
                log_probs = log_probs.masked_fill(padded, 0)
            if global_smoothing:
                sum_log_probs = log_probs.sum(-1)
                dist.all_reduce(sum_log_probs, group=group)
                mean_log_probs = sum_log_probs / vocab
            else:
                mean_log_probs = log_probs.mean(-1)
            loss = (1 - s) * loss - s * mean_log_probs
        loss = torch.where(counted, loss, 0)
        ctx.smoothing, ctx.vocab = label_smoothing, vocab
        ctx.save_for_backward(softmax, mine, local_target, counted)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, mine, local_target, counted = ctx.saved_tensors
        grad = softmax.clone()
        one_hot = torch.zeros_like(grad).scatter_(-1, local_target.unsqueeze(-1), mine.unsqueeze(-1).to(grad.dtype))
        if ctx.smoothing > 0:
            s = ctx.smoothing * ctx.vocab / (ctx.vocab - 1)
            grad = grad - (1 - s) * one_hot - s / ctx.vocab
        else:
            grad = grad - one_hot
        grad = grad * (grad_output * counted).unsqueeze(-1)
        return grad, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group,
    label_smoothing: float = 0.0,
    global_smoothing: bool = True,
    real_vocab: int | None = None,
) -> torch.Tensor:
    """Per-token loss of this rank's vocabulary slice of the logits [.., V/TP] (the same on every TP rank)."""
    loss = VocabParallelCrossEntropy.apply(logits, target, group, label_smoothing, global_smoothing, real_vocab)
    return loss.to(logits.dtype)
