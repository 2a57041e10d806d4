"""A token classifier for the training-step features (tests/test_model_case_steps.py): pre-norm residual MLP blocks
over [B, S, D] features and a head to V classes, each block's MLP under activation checkpointing when the model is
built with `checkpoint=True` (torch.utils.checkpoint inside the block's forward: the module names stay)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

BATCH, SEQ, DIM, HIDDEN, CLASSES, BLOCKS = 8, 4, 8, 16, 8, 2
IGNORE = -100  # labels of tokens the loss leaves out


class Block(nn.Module):
    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.act = nn.GELU()
        self.down = nn.Linear(HIDDEN, DIM)
        self.checkpointed = checkpointed

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(self.norm(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:  # the MLP's forward runs again in the backward
            return x + checkpoint(self.mlp, x, use_reentrant=False)
        return x + self.mlp(x)


class Classifier(nn.Module):
    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(checkpointed) for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(gen: torch.Generator, checkpointed: bool = False) -> Classifier:
    model = Classifier(checkpointed).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            p.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else noise / p.shape[-1] ** 0.5)
    return model


def make_inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Features, labels with tokens left out unevenly (rows 1 and 3 keep one token each, the rest about half), so
    that micro-batches and DP ranks carry different token counts, and the step's token count."""
    x = torch.randn(BATCH, SEQ, DIM, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, CLASSES, (BATCH, SEQ), generator=gen)
    dropped = torch.rand(BATCH, SEQ, generator=gen) < 0.5
    dropped[1, 1:] = dropped[3, 1:] = True
    dropped[:, 0] = False  # every row keeps a token
    labels[dropped] = IGNORE
    return {"x": x, "labels": labels, "tokens_in_step": (labels != IGNORE).sum()}
