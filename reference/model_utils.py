"""Single-device reference for ``nemo_rl.distributed.model_utils`` (semantics: docs/ops/model_utils.md).

Plain torch on full (unsharded) tensors, differentiable with ordinary autograd. Softmax-family
math runs in the compute dtype ``promote_types(x.dtype, float32)`` and outputs stay in it.
Ids outside ``[0, V)`` (e.g. -100 for masked positions) give 0 and a zero gradient.
"""

from typing import Optional

import torch

from shardcheck.reference import math_dtype


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """x in its compute dtype: float32 at least, float64 stays float64 (reference.math_dtype)."""
    return x.to(math_dtype(x.dtype))


def _gather_or_zero(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """values[..., ids] along the last dim; 0 (and no gradient) where ids is outside [0, V)."""
    V = values.shape[-1]
    valid = (ids >= 0) & (ids < V)
    picked = values.gather(-1, ids.clamp(0, V - 1))
    return torch.where(valid, picked, torch.zeros((), dtype=picked.dtype))


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """[B,S,V] log-softmax over the vocab."""
    return torch.log_softmax(_upcast(logits), dim=-1)


def softmax(logits: torch.Tensor) -> torch.Tensor:
    """[B,S,V] softmax over the vocab."""
    return torch.softmax(_upcast(logits), dim=-1)


def logprob(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[B,S] log-prob of ``target`` (already shifted)."""
    return _gather_or_zero(log_softmax(logits), target.unsqueeze(-1)).squeeze(-1)


def cross_entropy(student_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """[B,S] H(p,q) = -sum_v p_v log q_v, p = softmax(target) (no gradient), q = softmax(student).

    Terms with p_v = 0 count as 0 (so a -inf logit on both sides gives no NaN).
    """
    p = softmax(target_logits.detach())
    log_q = log_softmax(student_logits)
    terms = torch.where(p > 0, p * log_q, torch.zeros((), dtype=log_q.dtype))
    return -terms.sum(-1)


def next_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """[B,S-1]: logprob at position t of token input_ids[t+1]."""
    return logprob(logits[:, :-1], input_ids[:, 1:])


def filter_logits(logits: torch.Tensor, top_k: Optional[int], top_p: float) -> torch.Tensor:
    """Top-k then top-p filtering; filtered logits become -inf (compute dtype).

    top-k keeps every logit >= the k-th largest (ties may keep more); None or <= 0 disables.
    top-p runs on the top-k-renormalised distribution: sort ascending, drop tokens whose
    cumulative probability is <= 1 - p, always keep the largest; top_p == 1.0 disables.
    """
    x = _upcast(logits)
    V = x.shape[-1]
    if top_k is not None and 0 < top_k < V:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        probs = torch.softmax(x, dim=-1)
        sorted_probs, order = torch.sort(probs, dim=-1, stable=True)
        drop_sorted = sorted_probs.cumsum(-1) <= 1.0 - top_p
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def sampling_logprob(logits: torch.Tensor, target: torch.Tensor, top_k: Optional[int], top_p: float) -> torch.Tensor:
    """[B,S] log-softmax over the survivors of filtering, at ``target``; filtered target -> -inf."""
    log_probs = torch.log_softmax(filter_logits(logits, top_k, top_p), dim=-1)
    return _gather_or_zero(log_probs, target.unsqueeze(-1)).squeeze(-1)


def next_token_sampling_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, top_k: Optional[int], top_p: float, temperature: float
) -> torch.Tensor:
    """[B,S-1] sampling logprobs of the next token, logits divided by ``temperature`` first."""
    scaled = _upcast(logits) / temperature
    return sampling_logprob(scaled[:, :-1], input_ids[:, 1:], top_k, top_p)


def gather_logprob(logits: torch.Tensor, global_indices: torch.Tensor) -> torch.Tensor:
    """[B,S,K] full-vocab log-probs at ``global_indices`` (duplicates allowed)."""
    return _gather_or_zero(log_softmax(logits), global_indices)


def vocab_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k over the vocab: values [B,S,k] (descending, compute dtype) and int64 ids."""
    values, ids = torch.topk(_upcast(logits), k, dim=-1)
    return values, ids


def gather_logits(logits: torch.Tensor, global_indices: torch.Tensor) -> torch.Tensor:
    """[B,S,K] raw logits (compute dtype) at ``global_indices``."""
    return _gather_or_zero(_upcast(logits), global_indices)


class _Entropy(torch.autograd.Function):
    """sum_v p_v log p_v with the closed-form gradient p·(log p − H)·g.

    Autograd through softmax and log_softmax sums two nearly equal terms, which loses the
    gradient of almost one-hot rows entirely (1e-18 values come out as 0 or with the wrong sign)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:
        log_p = log_softmax(logits)
        p = log_p.exp()
        # Mask log p before the product so a -inf logit gives neither a NaN value nor a NaN gradient.
        safe_log_p = torch.where(p > 0, log_p, torch.zeros((), dtype=log_p.dtype))
        h = (p * safe_log_p).sum(-1)
        ctx.save_for_backward(p, safe_log_p, h)
        ctx.input_dtype = logits.dtype
        return h

    @staticmethod
    def backward(ctx, grad_h: torch.Tensor) -> torch.Tensor:
        p, safe_log_p, h = ctx.saved_tensors
        return (p * (safe_log_p - h.unsqueeze(-1)) * grad_h.unsqueeze(-1)).to(ctx.input_dtype)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """[B,S] sum_v p_v log p_v (<= 0); terms with p_v = 0 count as 0."""
    return _Entropy.apply(logits)


def distillation_topk_logprobs(
    student_logits: torch.Tensor,
    teacher_topk_logits: torch.Tensor,
    teacher_topk_indices: torch.Tensor,
    zero_outside_topk: bool,
    calculate_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(student_topk_logprobs, teacher_topk_logprobs, H_all or None), last position dropped."""
    if zero_outside_topk:
        student = gather_logprob(student_logits, teacher_topk_indices)
    else:
        student = torch.log_softmax(gather_logits(student_logits, teacher_topk_indices), dim=-1)
    teacher = torch.log_softmax(_upcast(teacher_topk_logits), dim=-1)
    h_all = entropy(student_logits)[:, :-1] if calculate_entropy else None
    return student[:, :-1], teacher[:, :-1], h_all


def hidden_states_to_logprobs(hidden_states: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """hidden_states [S,B,H], weight [V,H], target [B,S] unshifted -> [B,S-1] next-token logprobs.

    The projection runs in the input dtype (as an LM head does); the softmax in the compute dtype.
    """
    logits = torch.matmul(hidden_states.transpose(0, 1), weight.t())  # [B,S,V]
    return next_token_logprobs(logits, target)


def packed_next_token_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    unpacked_seqlen: int,
    target_is_pre_rolled: bool = False,
    top_k: Optional[int] = None,
    top_p: float = 1.0,
    temperature: float = 1.0,
) -> torch.Tensor:
    """[B, unpacked_seqlen-1] log-probs of packed sequences: logits [1,T,V], target [1,T] (unshifted,
    or already shifted within each sequence), sequence i at [cu[i], cu[i+1]).  Row i holds the first
    padded_len_i - 1 next-token log-probs of sequence i, zeros after."""
    bounds = [int(b) for b in cu_seqlens_padded.tolist()]
    rows = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        seq_logits, seq_target = logits[:, start:end], target[:, start:end]
        if not target_is_pre_rolled:
            seq_target = seq_target.roll(shifts=-1, dims=1)
        scaled = _upcast(seq_logits[:, :-1]) / temperature
        row = sampling_logprob(scaled, seq_target[:, :-1], top_k, top_p)[0, : unpacked_seqlen - 1]
        rows.append(torch.nn.functional.pad(row, (0, unpacked_seqlen - 1 - row.shape[0])))
    return torch.stack(rows)
