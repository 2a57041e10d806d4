"""BROKEN: each rank's loss is the mean over its own tokens, and the ranks' losses (and, through FSDP2's summed
reduction, their gradients) are then summed over DP and CP: the loss and every gradient come out dp x cp times
too large (torchtitan#3280's "TP 2 + CP 2 loss about half of TP 4", Megatron-LM#673's CP loss scaled by cp_size).
The forward is right; the first divergence is the loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _decoder_plan import parallelize  # noqa: F401  (the example's own plan; only its loss is broken)


def loss(logits: torch.Tensor, inputs: dict, ctx) -> torch.Tensor:
    logits = logits.float() if logits.dtype == torch.bfloat16 else logits
    # the bug: a mean over the local tokens, where the summand of the global mean divides by the global count
    return F.cross_entropy(logits.flatten(0, 1), inputs["targets"].flatten())
