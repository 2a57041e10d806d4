"""BROKEN: the gradient-accumulation bug of Hugging Face Transformers (2024): each micro-batch's loss is the mean over
its own tokens (summed over DP, so the DP ranks agree), and the micro-batches' losses averaged (divided by their
count): micro-batches of different token counts weigh their tokens differently, where the step's mean weighs every
token alike (the fix divides every micro-batch's token sum by the step's token count, `num_items_in_batch`)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _step_model import IGNORE
from _step_plan import clip_grad, optimizer, parallelize  # noqa: F401 (the plan's other functions, unchanged)

MICROBATCHES = 2  # the case's


def loss(logits: torch.Tensor, inputs: dict, ctx) -> torch.Tensor:
    labels = inputs["labels"]
    nll = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    tokens = (labels != IGNORE).sum()
    dist.all_reduce(tokens, group=ctx.group("dp"))  # this micro-batch's tokens on every DP rank
    return nll.to(logits.dtype) / tokens / MICROBATCHES
