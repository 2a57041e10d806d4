"""BROKEN: a vocabulary TP does not divide (31 over TP 2), padded as Megatron pads it, to a multiple of TP, but the
padded classes' logits are zeros instead of being masked out (-inf): the softmax gives them probability mass and
the loss and every gradient drift (Megatron-LM#1754: TP 1 and TP 2 losses differ).  The forward is right up to the
logits; the first divergence is the loss, at TP 2 only (TP 1 needs no padding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _decoder_plan import loss as summand
from _decoder_plan import parallelize  # noqa: F401  (the example's own plan; only its loss pads the vocabulary)


def loss(logits: torch.Tensor, inputs: dict, ctx) -> torch.Tensor:
    pad = -logits.shape[-1] % ctx.size("tp")
    logits = F.pad(logits, (0, pad))  # the bug: value=float("-inf") (or cutting the padding off) keeps them out
    return summand(logits, inputs, ctx)
