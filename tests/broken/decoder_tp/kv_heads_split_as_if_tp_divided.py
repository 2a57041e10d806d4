"""BROKEN: grouped key/value heads (2 of them) at TP 4, where TP splits the query heads finer than the key/value
heads: the plan keeps wk and wv whole, as it should, but picks each rank's key/value head as if the TP ranks divided
the key/value heads between them, dealt round-robin (rank r takes head r % kv_heads), where rank r's query heads use
head r·kv_heads // tp.  It runs (every shape fits) and ranks 1 and 2 attend with the other head's keys and values.
The projections agree (wk and wv are whole on every rank); the first diverging module is layers.0.attention.wo,
whose input is the attention's output (SDPA is not a module)."""

from __future__ import annotations

from _decoder_plan import loss, sequence_and_data_parallel, tensor_parallel  # noqa: F401  (the example's own plan)
from torch import nn


def dealt_round_robin(rank: int, tp: int, kv_heads: int) -> int:
    return rank % kv_heads  # the bug: rank * kv_heads // tp


def parallelize(model: nn.Module, ctx) -> nn.Module:
    if ctx.size("tp") > 1:
        tensor_parallel(model, ctx.mesh["tp"], kv_head=dealt_round_robin)
    sequence_and_data_parallel(model, ctx)
    return model
