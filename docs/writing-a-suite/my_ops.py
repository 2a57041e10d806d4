"""A team's vocab-parallel cross-entropy: the module under test in docs/writing-a-suite.md.

Nothing here knows about shardcheck: it is the code a training job calls, written with torch.distributed only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, group: dist.ProcessGroup | None = None, ignore_index: int = -100
) -> torch.Tensor:
    """Per-token cross-entropy of logits sharded over the vocabulary across the ranks of `group`.

    logits: [B, S, V_local], this rank's contiguous piece of the vocabulary (pieces in rank order, sizes as
    torch.chunk cuts V: they may differ by one rank to the next). target: [B, S] token ids in [0, V), the same
    on every rank of the group. Returns the loss [B, S] in promote_types(logits.dtype, float32), the same on
    every rank; 0, with no gradient, where target == ignore_index.
    """
    if target.shape != logits.shape[:-1]:
        raise ValueError(
            f"target {tuple(target.shape)} does not match logits {tuple(logits.shape)} without the vocab dim"
        )
    return _VocabParallelCrossEntropy.apply(logits, target, group, ignore_index)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, ignore_index):
        x = logits.to(torch.promote_types(logits.dtype, torch.float32))
        v_local = x.shape[-1]
        local_target = target - _vocab_start(v_local, group, x.device)
        owned = (local_target >= 0) & (local_target < v_local)  # the target's logit is on this rank
        local_target = local_target.clamp(0, max(v_local - 1, 0))

        # log Σ exp over the whole vocabulary, stable: the global max first, then the sum of exponentials.
        row_max = x.amax(dim=-1)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        exp = torch.exp(x - row_max.unsqueeze(-1))
        picked = torch.where(owned, x.gather(-1, local_target.unsqueeze(-1)).squeeze(-1), 0.0)
        sums = torch.stack([exp.sum(dim=-1), picked])
        dist.all_reduce(sums, group=group)  # Σ exp and the target's logit, per token, in one call
        sum_exp, target_logit = sums.unbind(0)

        valid = target != ignore_index
        loss = torch.where(valid, sum_exp.log() + row_max - target_logit, 0.0)
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local_target, owned & valid, valid)
        ctx.input_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        # d loss / d logits = softmax − one_hot(target), all local: the softmax was saved, and the one-hot lives
        # on the rank that owns the target.
        softmax, local_target, owned, valid = ctx.saved_tensors
        g = torch.where(valid, grad_loss, 0.0).unsqueeze(-1)
        one_hot = torch.zeros_like(softmax).scatter_(
            -1, local_target.unsqueeze(-1), owned.unsqueeze(-1).to(softmax.dtype)
        )
        return ((softmax - one_hot) * g).to(ctx.input_dtype), None, None, None


def _vocab_start(v_local: int, group: dist.ProcessGroup | None, device: torch.device) -> int:
    """Where this rank's piece starts in the vocabulary: the sizes of the pieces of the ranks before it."""
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([v_local], device=device), group=group)
    return int(sum(sizes[: dist.get_rank(group)]))
