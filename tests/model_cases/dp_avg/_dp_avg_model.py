"""The model of suite dp_avg: learned positions (`wpe(pos)`, [S, D]: no batch dim, the same on every DP rank)
added to the input, two residual MLP blocks and a regression head."""

from __future__ import annotations

import torch
from torch import nn

BATCH, SEQ, DIM, HIDDEN = 8, 4, 8, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.act = nn.GELU()
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wpe = nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        h = x + self.wpe(pos)  # pos: the positions of the rank's tokens (under CP its piece of them)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build(gen: torch.Generator) -> Net:
    model = Net().double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) / p.shape[-1] ** 0.5)
    return model


def inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "x": torch.randn(BATCH, SEQ, DIM, generator=gen, dtype=torch.float64),
        "y": torch.randn(BATCH, SEQ, 1, generator=gen, dtype=torch.float64),
        "pos": torch.arange(SEQ),
    }


def mean_loss(out: torch.Tensor, inputs: dict, ctx=None) -> torch.Tensor:
    """The mean squared error over the rows it is given: on one device the whole batch's, on a DP rank its own."""
    return ((out - inputs["y"]) ** 2).mean()
