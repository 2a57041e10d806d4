"""A token classifier for batch invariance (tests/test_model_batch_invariance.py): pre-norm residual MLP blocks over
[B, S, D] features and a head to C classes."""

from __future__ import annotations

import torch
from torch import nn

BATCH, SEQ, DIM, HIDDEN, CLASSES, BLOCKS = 8, 4, 8, 16, 8, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.act = nn.GELU()
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(self.norm(x))))


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(gen: torch.Generator) -> Classifier:
    model = Classifier().double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            p.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else noise / p.shape[-1] ** 0.5)
    return model


def make_inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
    x = torch.randn(BATCH, SEQ, DIM, generator=gen, dtype=torch.float64)
    return {"x": x, "labels": torch.randint(0, CLASSES, (BATCH, SEQ), generator=gen)}
