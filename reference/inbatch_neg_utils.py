"""Single-device reference for in-batch negatives across DP ranks (seed 000).

Plain torch, any dtype, no process group. A "gather" on one device is the concatenation
of every rank's piece, so the gathers take the list of per-rank pieces. The contrastive
step is the bi-encoder loss over the global batch; `contrastive_loss_local_only` is the
same value with the documented `preserve_grad=False` gradient. See
docs/ops/inbatch_neg_utils.md.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from shardcheck.reference import math_dtype


def gather(pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    """What an all-gather along dim 0 returns: every rank's piece, in rank order."""
    return torch.cat(list(pieces), dim=0)


def gather_with_dim1_padding(pieces: Sequence[torch.Tensor], padding_value: int | float | bool = 0) -> torch.Tensor:
    """Each piece right-padded along dim 1 to the longest dim 1 with `padding_value`, then gathered."""
    longest = max(p.shape[1] for p in pieces)
    padded = []
    for p in pieces:
        fill = torch.full(
            (p.shape[0], longest - p.shape[1], *p.shape[2:]), padding_value, dtype=p.dtype, device=p.device
        )
        padded.append(torch.cat([p, fill], dim=1))
    return gather(padded)


def check_mask_args(
    scores: torch.Tensor, passage_doc_ids: torch.Tensor, train_n_passages: int, rank: int, local_batch_size: int
) -> None:
    """ValueError on arguments the mask cannot be applied to (sizes named)."""
    if scores.ndim != 2:
        raise ValueError(
            f"scores must be 2-D [local_batch_size, B_global * train_n_passages], got shape {tuple(scores.shape)}"
        )
    if passage_doc_ids.ndim != 1 or passage_doc_ids.shape[0] != scores.shape[1]:
        raise ValueError(
            f"passage_doc_ids shape {tuple(passage_doc_ids.shape)} does not match the {scores.shape[1]} score columns"
        )
    if passage_doc_ids.is_floating_point() or passage_doc_ids.is_complex() or passage_doc_ids.dtype == torch.bool:
        raise ValueError(f"passage_doc_ids must be an integer tensor, got dtype {passage_doc_ids.dtype}")
    if train_n_passages < 1 or local_batch_size < 0 or rank < 0:
        raise ValueError(
            f"train_n_passages {train_n_passages} must be >= 1, local_batch_size {local_batch_size} and "
            f"rank {rank} >= 0"
        )
    if scores.shape[0] != local_batch_size:
        raise ValueError(f"scores has {scores.shape[0]} rows, expected local_batch_size {local_batch_size}")
    last_positive = ((rank + 1) * local_batch_size - 1) * train_n_passages
    if local_batch_size and last_positive >= scores.shape[1]:
        raise ValueError(
            f"rank {rank} with local_batch_size {local_batch_size} and train_n_passages {train_n_passages} "
            f"puts a positive at column {last_positive}, but scores has {scores.shape[1]} columns"
        )


def masked_scores(
    scores: torch.Tensor, passage_doc_ids: torch.Tensor, train_n_passages: int, rank: int, local_batch_size: int
) -> torch.Tensor:
    """Out of place: row i (global query rank·local_batch_size + i) gets finfo.min on every column other
    than its positive whose doc id equals the positive's. One row at a time, as docs/ops/inbatch_neg_utils.md
    states it."""
    check_mask_args(scores, passage_doc_ids, train_n_passages, rank, local_batch_size)
    fill = torch.finfo(scores.dtype).min
    rows = []
    for i in range(local_batch_size):
        positive = (rank * local_batch_size + i) * train_n_passages
        duplicate = passage_doc_ids == passage_doc_ids[positive]
        duplicate[positive] = False
        rows.append(scores[i].masked_fill(duplicate.to(scores.device), fill))
    return torch.stack(rows) if rows else scores.clone()


# ---- the bi-encoder contrastive step ------------------------------------------------------


def encode(features: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The tiny encoder of the suite's contrastive step: one linear layer."""
    return F.linear(features, weight, bias)


def loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """Cross entropy runs in float32 at least (float64 stays float64)."""
    return math_dtype(dtype)


def contrastive_row_losses(
    queries: torch.Tensor,
    passages: torch.Tensor,
    passage_doc_ids: torch.Tensor,
    train_n_passages: int,
    temperature: float,
    rank: int = 0,
) -> torch.Tensor:
    """Per-query cross entropy of DP rank `rank`'s b queries [b, H] against all passages [B·n, H]: scores /
    temperature, duplicates of each positive masked, target the positive's column (global query g: g·n)."""
    b = queries.shape[0]
    scores = masked_scores(queries @ passages.T / temperature, passage_doc_ids, train_n_passages, rank, b)
    targets = (rank * b + torch.arange(b)) * train_n_passages
    return F.cross_entropy(scores.to(loss_dtype(scores.dtype)), targets.to(scores.device), reduction="none")


def contrastive_loss(
    query_features: torch.Tensor,
    passage_features: torch.Tensor,
    passage_doc_ids: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    train_n_passages: int,
    temperature: float,
) -> torch.Tensor:
    """The step on one device over the global batch: mean cross entropy over all B queries."""
    queries = encode(query_features, weight, bias)
    passages = encode(passage_features, weight, bias)
    return contrastive_row_losses(queries, passages, passage_doc_ids, train_n_passages, temperature).mean()


def contrastive_loss_local_only(
    query_features: torch.Tensor,
    passage_features: torch.Tensor,
    passage_doc_ids: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    train_n_passages: int,
    temperature: float,
    dp: int,
) -> torch.Tensor:
    """The same loss value, with the gradient of `preserve_grad=False` at DP size `dp`: DP rank r's summand
    (its queries' losses / B) sees every other rank's passages detached, so only its own loss's gradient
    reaches its passages. The encoder weight's gradient is the sum over the DP ranks' summands (DDP)."""
    b_global = query_features.shape[0]
    if b_global % dp:
        raise ValueError(f"global batch {b_global} is not divisible by dp {dp}")
    b_local = b_global // dp
    queries = encode(query_features, weight, bias)
    passages = encode(passage_features, weight, bias)
    per_rank = passages.shape[0] // dp
    total = None
    for r in range(dp):
        own = torch.zeros(passages.shape[0], 1, dtype=torch.bool)
        own[r * per_rank : (r + 1) * per_rank] = True
        seen = torch.where(own.to(passages.device), passages, passages.detach())
        rows = contrastive_row_losses(
            queries[r * b_local : (r + 1) * b_local], seen, passage_doc_ids, train_n_passages, temperature, rank=r
        )
        summand = rows.sum() / b_global
        total = summand if total is None else total + summand
    return total
