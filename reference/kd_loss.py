"""Single-device reference for the forward-KL knowledge-distillation loss (seed 004).

Plain torch, differentiable by ordinary autograd, any dtype. The harness takes golden
values and gradients from here (typically in float64). See docs/ops/kd_loss.md.
"""

from typing import Optional, Union

import torch
import torch.nn.functional as F

from shardcheck.reference import math_dtype


def _compute_dtype(student_dtype: torch.dtype, teacher_dtype: torch.dtype, fp32_upcast: bool) -> torch.dtype:
    # Softmax math runs in at least float32 when upcasting; float64 stays float64.
    dtype = torch.promote_types(student_dtype, teacher_dtype)
    return math_dtype(dtype) if fp32_upcast else dtype


def _check_shapes(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor) -> None:
    if student_logits.ndim < 1:
        raise ValueError(f"logits need a vocab dim, got student_logits shape {tuple(student_logits.shape)}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student_logits shape {tuple(student_logits.shape)} != teacher_logits shape {tuple(teacher_logits.shape)}"
        )
    if labels.shape != student_logits.shape[:-1]:
        raise ValueError(
            f"labels shape {tuple(labels.shape)} != logits leading shape {tuple(student_logits.shape[:-1])}"
        )


def kd_loss_per_token(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    temperature: float = 1.0,
    fp32_upcast: bool = True,
) -> torch.Tensor:
    """Per-valid-token ``T² · Σ_v P_v (log P_v − log Q_v)``, shape ``[num_valid]``, in valid-token order."""
    _check_shapes(student_logits, teacher_logits, labels)
    dtype = _compute_dtype(student_logits.dtype, teacher_logits.dtype, fp32_upcast)
    vocab = student_logits.shape[-1]
    valid = (labels != ignore_index).reshape(-1)
    s = student_logits.reshape(-1, vocab)[valid].to(dtype) / temperature
    t = teacher_logits.reshape(-1, vocab)[valid].to(dtype) / temperature
    log_p = F.log_softmax(t, dim=-1)
    log_q = F.log_softmax(s, dim=-1)
    p = log_p.exp()
    # Zero the log-ratio itself (not only the product) where P == 0: a teacher -inf logit
    # then gives 0 * 0 in the forward and no 0 * inf = NaN in the backward.
    log_ratio = torch.where(p > 0, log_p - log_q, torch.zeros_like(log_p))
    return (p * log_ratio).sum(dim=-1) * (temperature**2)


def kd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = -100,
    temperature: float = 1.0,
    fp32_upcast: bool = True,
    num_batch_labels: Optional[Union[int, torch.Tensor]] = None,
) -> torch.Tensor:
    """Scalar KD loss: ``sum(kl) / num_batch_labels`` if given, else mean over valid tokens.

    With no valid token the result is 0, still connected to the graph (zero gradients):
    the sum over an empty selection is 0 and the mean divides by max(count, 1).
    """
    kl = kd_loss_per_token(student_logits, teacher_logits, labels, ignore_index, temperature, fp32_upcast)
    denom = num_batch_labels if num_batch_labels is not None else max(kl.numel(), 1)
    return kl.sum() / denom
