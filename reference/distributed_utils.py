"""Single-device references for distributed_utils (semantics: docs/ops/distributed_utils.md).

Only the ops that compute values have one: the loss reduction, what every eval sample scores,
and the gradient that accumulating micro-batches must reach.  Barriers, first-rank-per-node
sections and logging are about processes; their suites check properties instead.
"""

from __future__ import annotations

import torch


def reduce_loss(
    losses: torch.Tensor, num_tokens: torch.Tensor, per_token_loss: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, denominator) of every micro-batch on one device: loss = the sum of `losses` ([L]) in
    float32 or better, shape [1]; denominator = the sum of the token counts `num_tokens` (int64, no
    truncation) when `per_token_loss`, else the number of losses L."""
    loss = losses.detach().to(torch.promote_types(losses.dtype, torch.float32)).sum().reshape(1)
    if per_token_loss:
        denominator = num_tokens.to(torch.int64).sum().reshape(1)
    else:
        denominator = torch.tensor([losses.numel()], dtype=torch.int64)
    return loss, denominator


def score_samples(values: torch.Tensor) -> torch.Tensor:
    """The eval "model": one score per sample (a fixed, nonlinear function of the sample)."""
    return torch.tanh(values) * 2.0 + values**2


def mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    """Linear(F, H) -> tanh -> Linear(H, O), as torch.nn.Linear computes it."""
    return torch.tanh(x @ w1.T + b1) @ w2.T + b2


def accumulated_gradients(
    x: torch.Tensor, y: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor
) -> torch.Tensor:
    """Gradient of Σ_m mean((mlp(x[m]) − y[m])²) over micro-batches m (x: [M, B, F], y: [M, B, O]) with
    respect to (w1, b1, w2, b2), flattened in that order: what gradient accumulation over M
    micro-batches of the full batch B reaches on one device."""
    params = [p.detach().clone().requires_grad_() for p in (w1, b1, w2, b2)]
    with torch.enable_grad():
        loss = sum(((mlp(x[m], *params) - y[m]) ** 2).mean() for m in range(x.shape[0]))
        grads = torch.autograd.grad(loss, params)
    return torch.cat([g.reshape(-1) for g in grads])
