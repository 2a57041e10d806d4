"""A plain (not DTensor) activation's layout in a model case, inferred: from its local shape against the full one,
and, for the gradient arriving at it, from how the batch is split (harness/core/model_case.py uses both)."""

from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard

from shardcheck.harness.core.layout import Layout
from shardcheck.harness.core.rank_context import RankContext
from shardcheck.harness.core.topology import MESH_DIMS, mesh_dims


def layout_by_shape(local_shape: tuple, full_shape: tuple, default: Layout, ctx: RankContext) -> Layout:
    """A plain activation's layout: the batch's dp/cp placements, or replicated over those of them the value is whole
    on (learned positions `wpe(arange(S))`: the same [S, D] on every DP rank), and over tp the one dim (if any) whose
    split gives the local shape (a column-parallel projection's output, a sequence-parallel region's).  None fits:
    the default, and the comparison names the shape."""
    sizes = mesh_dims(ctx.mesh).sizes
    for base in _batch_or_replicated(default):
        dp, cp, _ = base.placements
        for lay in [base] + [Layout(dp=dp, cp=cp, tp=Shard(d)) for d in range(len(full_shape))]:
            # A dp/cp split leaving some rank an empty piece is no candidate: on rank 0 a [1, S, D] value replicated
            # over dp would pass for its dp shard and on rank 1 not, and the ranks' layouts of its gradient would
            # differ (one summing it over dp, one not).  No batch is split that way (Layout.misfit refuses it).
            if lay.misfit(full_shape, sizes, ctx.full_inputs, empty_pieces=("tp",)):
                continue
            try:
                shape = tuple(len(ix) for ix in lay.mesh_indices(full_shape, ctx.mesh, ctx.full_inputs))
            except (IndexError, ValueError):  # a rule that does not fit this tensor's dims
                continue
            if shape == tuple(local_shape):
                return lay
    return default


def _batch_or_replicated(batch: Layout) -> list[Layout]:
    """The dp/cp placements an activation may have, replicated over tp: the batch's first, then replicated over dp,
    over cp, over both (each only where the batch is split there)."""
    dp, cp, _ = batch.placements
    pairs = [(dp, cp), (Replicate(), cp), (dp, Replicate()), (Replicate(), Replicate())]
    kept = [pair for i, pair in enumerate(pairs) if pair not in pairs[:i]]  # where the batch is replicated already
    return [Layout(dp=d, cp=c) for d, c in kept]


def gradient_over_batch(layout: Layout, batch: Layout, sizes: dict[str, int]) -> Layout:
    """The layout of the gradient arriving at a value of `layout` (a plain activation's, inferred or declared): where
    the batch is split over a mesh dim (of size > 1) and the value is replicated there, each rank's gradient is its
    own rows' (or tokens') share of the whole one, so it is `Partial` there and the harness sums it to compare."""
    dp_cp = [
        Partial() if isinstance(p, Replicate) and not isinstance(b, Replicate) and sizes[d] > 1 else p
        for d, p, b in zip(MESH_DIMS[:2], layout.placements[:2], batch.placements[:2])
    ]
    return Layout(*dp_cp, layout.placements[2])
