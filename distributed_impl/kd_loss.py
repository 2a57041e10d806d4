"""Forward-KL knowledge-distillation loss, optionally vocab-sharded over a TP group.

Mirrors ``nemo_automodel.components.loss.kd_loss`` (seed 004); semantics in
docs/ops/kd_loss.md. All per-token work goes through one autograd Function,
``_ForwardKL``, that handles both the single-device and the TP case, chunked or not:

- forward: per chunk of valid tokens, upcast + divide by T, global log-sum-exp of
  teacher and student (all-reduce MAX then SUM when sharded), local KL terms; one SUM
  all-reduce of the per-token KL at the end. Saves only the inputs and three [N] vectors.
- backward: analytic and communication-free. The per-token KL is replicated across TP and
  every rank sees the same upstream gradient, so each rank returns the gradient of its own
  vocab shard (identity backward of the all-reduce; nothing is all-reduced again).
"""

from typing import Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard


def _infer_tp_group_from_dtensor(logits: torch.Tensor) -> Optional[dist.ProcessGroup]:
    """If *logits* is a DTensor sharded on the vocab (last) dim, return that mesh dim's group.

    Returns None for plain tensors and DTensors not sharded on the last dim. Also None when
    the vocab is sharded over several mesh dims (no single group); the caller then takes
    the full tensor, which is still correct.
    """
    if not isinstance(logits, DTensor):
        return None
    vocab_dim = logits.ndim - 1
    mesh_dims = [
        mesh_dim
        for mesh_dim, placement in enumerate(logits.placements)
        if isinstance(placement, Shard) and placement.dim in (-1, vocab_dim)
    ]
    if len(mesh_dims) != 1:
        return None
    return logits.device_mesh.get_group(mesh_dims[0])


def _compute_dtype(student_dtype: torch.dtype, teacher_dtype: torch.dtype, fp32_upcast: bool) -> torch.dtype:
    # Softmax math runs in at least float32 when upcasting; float64 stays float64.
    dtype = torch.promote_types(student_dtype, teacher_dtype)
    return torch.promote_types(dtype, torch.float32) if fp32_upcast else dtype


def _row_max(x: torch.Tensor) -> torch.Tensor:
    # An uneven split may leave a rank with an empty vocab shard: its max is -inf.
    if x.shape[-1] == 0:
        return x.new_full(x.shape[:-1], float("-inf"))
    return x.amax(dim=-1)


def _global_log_softmaxes(
    t: torch.Tensor, s: torch.Tensor, tp_group: Optional[dist.ProcessGroup]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full-vocab log-softmax of teacher and student chunks (local shards), plus the per-row
    max ``m`` and ``log Σ exp(x − m)``, each ``[2, n]``, to recompute them in backward.

    ``(x − m) − log_norm``, not ``x − (m + log_norm)``: it rounds at the scale of log V, not of
    the largest logit.  Teacher and student share each collective (MAX, then SUM, on ``[2, n]``).
    """
    m = torch.stack([_row_max(t), _row_max(s)])
    if tp_group is not None:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    log_p, log_q = t - m[0, :, None], s - m[1, :, None]
    se = torch.stack([log_p.exp().sum(dim=-1), log_q.exp().sum(dim=-1)])
    if tp_group is not None:
        dist.all_reduce(se, op=dist.ReduceOp.SUM, group=tp_group)
    log_norm = se.log()
    return log_p.sub_(log_norm[0, :, None]), log_q.sub_(log_norm[1, :, None]), m, log_norm


def _log_softmaxes(t, s, m, log_norm):
    """The log-softmaxes again from the saved max and normaliser (no communication)."""
    return (t - m[0, :, None]).sub_(log_norm[0, :, None]), (s - m[1, :, None]).sub_(log_norm[1, :, None])


def _scaled(x: torch.Tensor, dtype: torch.dtype, temperature: float) -> torch.Tensor:
    x = x.to(dtype)
    return x / temperature if temperature != 1.0 else x  # no copy for T = 1


def _safe_log_ratio(p: torch.Tensor, log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    # Terms with P == 0 count as 0: zero the ratio itself so a teacher -inf gives no NaN.
    return torch.where(p > 0, log_p - log_q, 0.0)


class _ForwardKL(torch.autograd.Function):
    """Per-token ``Σ_v P_v (log P_v − log Q_v)`` over the full vocab, ``[N]``, replicated on TP.

    Inputs are ``[N, V_local]`` logits in their own dtype; each chunk is upcast and scaled
    by 1/T on the fly, so peak extra memory is O(chunk · V_local) in the compute dtype.
    Backward recomputes the probabilities per chunk from the saved log-sum-exps.
    """

    @staticmethod
    def forward(
        ctx,
        t_logits: torch.Tensor,
        s_logits: torch.Tensor,
        tp_group: Optional[dist.ProcessGroup],
        chunk_size: int,
        temperature: float,
        compute_dtype: torch.dtype,
    ) -> torch.Tensor:
        n = s_logits.shape[0]
        step = chunk_size if chunk_size > 0 else max(n, 1)
        kl = s_logits.new_empty(n, dtype=compute_dtype)
        m = s_logits.new_empty((2, n), dtype=compute_dtype)
        log_norm = torch.empty_like(m)
        for a in range(0, n, step):  # range covers the last partial chunk
            b = min(a + step, n)
            t = _scaled(t_logits[a:b], compute_dtype, temperature)
            s = _scaled(s_logits[a:b], compute_dtype, temperature)
            log_p, log_q, m[:, a:b], log_norm[:, a:b] = _global_log_softmaxes(t, s, tp_group)
            p = log_p.exp()
            kl[a:b] = (p * _safe_log_ratio(p, log_p, log_q)).sum(dim=-1)
        if tp_group is not None:
            # Local vocab partial sums -> full-vocab KL, replicated on every TP rank.
            dist.all_reduce(kl, op=dist.ReduceOp.SUM, group=tp_group)
        ctx.save_for_backward(t_logits, s_logits, m, log_norm, kl)
        ctx.step = step
        ctx.temperature = temperature
        ctx.compute_dtype = compute_dtype
        return kl

    @staticmethod
    def backward(ctx, grad_kl: torch.Tensor):
        t_logits, s_logits, m, log_norm, kl = ctx.saved_tensors
        temperature, compute_dtype, step = ctx.temperature, ctx.compute_dtype, ctx.step
        want_t, want_s = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_t = torch.empty_like(t_logits) if want_t else None
        grad_s = torch.empty_like(s_logits) if want_s else None
        n = s_logits.shape[0]
        for a in range(0, n, step):
            b = min(a + step, n)
            t = _scaled(t_logits[a:b], compute_dtype, temperature)
            s = _scaled(s_logits[a:b], compute_dtype, temperature)
            log_p, log_q = _log_softmaxes(t, s, m[:, a:b], log_norm[:, a:b])
            p = log_p.exp()
            # 1/T from the chain rule through the logit scaling.
            g = grad_kl[a:b, None].to(compute_dtype) / temperature
            if want_s:
                # dKL/ds_v = Q_v - P_v: purely local to this vocab shard.
                grad_s[a:b] = g * (log_q.exp() - p)
            if want_t:
                # dKL/dt_v = P_v (log P_v - log Q_v - KL), KL being the full-vocab value.
                grad_t[a:b] = g * p * (_safe_log_ratio(p, log_p, log_q) - kl[a:b, None])
        return grad_t, grad_s, None, None, None, None


def _kl_forward_chunked(
    t_logits: torch.Tensor,
    s_logits: torch.Tensor,
    chunk_size: int,
    temperature: float = 1.0,
    fp32_upcast: bool = True,
) -> torch.Tensor:
    """Per-token forward KL ``[N]`` on one device, ``chunk_size`` tokens at a time (0: one chunk).

    ``t_logits`` / ``s_logits``: ``[N, vocab]`` logits of the valid tokens, unscaled, any dtype;
    upcast and division by T happen one chunk at a time. Not multiplied by T².
    """
    dtype = _compute_dtype(s_logits.dtype, t_logits.dtype, fp32_upcast)
    return _ForwardKL.apply(t_logits, s_logits, None, chunk_size, temperature, dtype)


def _kl_forward_tp(
    t_logits: torch.Tensor,
    s_logits: torch.Tensor,
    tp_group: dist.ProcessGroup,
    chunk_size: int = 0,
    temperature: float = 1.0,
    fp32_upcast: bool = True,
) -> torch.Tensor:
    """Per-token forward KL ``[N]`` over the full vocab from local vocab shards ``[N, V_local]``.

    Softmaxes are distributed by all-reduce (MAX, SUM) over ``tp_group``; the full vocab is
    never gathered. The result is replicated on all TP ranks; its backward gives each rank
    the gradient of its own shard. Uneven shards are fine. Not multiplied by T².
    """
    dtype = _compute_dtype(s_logits.dtype, t_logits.dtype, fp32_upcast)
    return _ForwardKL.apply(t_logits, s_logits, tp_group, chunk_size, temperature, dtype)


def _local_logits(logits: torch.Tensor, use_local_shard: bool) -> torch.Tensor:
    # TP path keeps the vocab shard; otherwise a DTensor is materialised in full.
    if not isinstance(logits, DTensor):
        return logits
    return logits.to_local() if use_local_shard else logits.full_tensor()


class KDLoss(nn.Module):
    """Forward KL ``KL(P_teacher ‖ P_student)`` · T², averaged over valid (non-ignored) tokens.

    TP: when the logits are DTensors sharded on the last dim (group inferred) or ``tp_group``
    is given (inputs are then local vocab shards), the softmaxes are distributed. ``chunk_size``
    > 0 processes that many valid tokens at a time, on both paths.
    """

    def __init__(
        self,
        ignore_index: int = -100,
        temperature: float = 1.0,
        fp32_upcast: bool = True,
        tp_group: Optional[dist.ProcessGroup] = None,
        chunk_size: int = 0,
    ):
        super().__init__()
        self.ignore_index = ignore_index
        self.temperature = temperature
        self.fp32_upcast = fp32_upcast
        self.tp_group = tp_group
        self.chunk_size = chunk_size

    def forward(
        self,
        student_logits: torch.Tensor,
        teacher_logits: torch.Tensor,
        labels: torch.Tensor,
        num_batch_labels: Optional[Union[int, torch.Tensor]] = None,
    ) -> torch.Tensor:
        """Scalar loss: ``sum(kl) / num_batch_labels`` when given, else mean over valid tokens."""
        tp_group = self.tp_group
        if tp_group is None:
            tp_group = _infer_tp_group_from_dtensor(student_logits)
        if tp_group is None:
            tp_group = _infer_tp_group_from_dtensor(teacher_logits)
        student_logits = _local_logits(student_logits, tp_group is not None)
        teacher_logits = _local_logits(teacher_logits, tp_group is not None)
        if isinstance(labels, DTensor):
            labels = labels.full_tensor()

        if student_logits.ndim < 1:
            raise ValueError(f"logits need a vocab dim, got student_logits shape {tuple(student_logits.shape)}")
        if student_logits.shape != teacher_logits.shape:
            raise ValueError(
                f"student_logits shape {tuple(student_logits.shape)} != "
                f"teacher_logits shape {tuple(teacher_logits.shape)}"
            )
        if labels.shape != student_logits.shape[:-1]:
            raise ValueError(
                f"labels shape {tuple(labels.shape)} != logits leading shape {tuple(student_logits.shape[:-1])}"
            )
        if self.chunk_size < 0:
            raise ValueError(f"chunk_size must be >= 0, got {self.chunk_size}")

        vocab = student_logits.shape[-1]
        valid = (labels != self.ignore_index).reshape(-1)
        # Explicit row count: an uneven split may leave this rank an empty shard (vocab == 0).
        s = student_logits.reshape(valid.numel(), vocab)[valid]
        t = teacher_logits.reshape(valid.numel(), vocab)[valid]
        n_valid = s.shape[0]
        if n_valid == 0:
            # 0 that stays connected to the graph: backward gives zero gradients, no error.
            # Labels are replicated across TP, so every rank skips the collectives together.
            dtype = _compute_dtype(s.dtype, t.dtype, self.fp32_upcast)
            return s.sum().to(dtype) + t.sum().to(dtype)

        if tp_group is not None:
            kl = _kl_forward_tp(t, s, tp_group, self.chunk_size, self.temperature, self.fp32_upcast)
        else:
            kl = _kl_forward_chunked(t, s, self.chunk_size, self.temperature, self.fp32_upcast)
        # T² keeps gradient magnitudes independent of T (Hinton et al., 2015).
        kl = kl * (self.temperature**2)
        denom = num_batch_labels if num_batch_labels is not None else n_valid
        return kl.sum() / denom
