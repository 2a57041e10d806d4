"""A layout's positions are kept per (placements, shape, coordinates, sizes) (harness/core/layout.py): what is kept is
what working them out gives, rules that read the inputs are worked out from each call's inputs, and a caller that
changes the list it got does not change what the next caller gets."""

from __future__ import annotations

import torch
from torch.distributed.tensor import Shard

from shardcheck.harness.core.layout import HeadTail, Layout, PackedHeadTail, Permuted, take

SIZES = {"dp": 1, "cp": 2, "tp": 1}


def _at(layout: Layout, shape: tuple, cp: int, inputs=None) -> list[list[int]]:
    return [ix.tolist() for ix in layout.indices(shape, {"cp": cp}, SIZES, inputs)]


def test_rules_that_read_the_inputs_follow_each_calls_inputs():
    packed = Layout(cp=PackedHeadTail(1))
    first = {"cu_seqlens_padded": torch.tensor([0, 8, 12])}
    second = {"cu_seqlens_padded": torch.tensor([0, 4, 12])}
    assert _at(packed, (1, 12), 0, first)[1] == [0, 1, 6, 7, 8, 11]
    assert _at(packed, (1, 12), 0, second)[1] == [0, 3, 4, 5, 10, 11]  # the same shape, other sequences
    permuted = Layout(cp=Permuted(1))
    assert _at(permuted, (2, 4), 1, {"seq_index": torch.tensor([3, 0, 2, 1])})[1] == [2, 1]
    assert _at(permuted, (2, 4), 1, {"seq_index": torch.tensor([1, 2, 0, 3])})[1] == [0, 3]


def test_kept_positions_are_those_worked_out_and_a_callers_list_is_its_own():
    layout = Layout(dp=Shard(0), cp=HeadTail(1), tp=Shard(2))
    sizes = {"dp": 2, "cp": 2, "tp": 2}
    full = torch.randn(4, 8, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    for dp in range(2):
        for cp in range(2):
            coords = {"dp": dp, "cp": cp, "tp": 1}
            once = layout.indices(full.shape, coords, sizes)
            assert [ix.tolist() for ix in once] == [
                ix.tolist() for ix in layout._compute_positions(full.shape, coords, sizes, None)
            ]
            once.append(torch.arange(1))  # a caller's own list
            again = layout.indices(full.shape, coords, sizes)
            assert len(again) == 3 and [ix.tolist() for ix in again] == [ix.tolist() for ix in once[:3]]
            piece = take(full, again)
            assert piece.shape == (2, 4, 3) and torch.equal(piece, full[again[0]][:, again[1]][:, :, again[2]])
    # an equal layout made elsewhere (a model case makes one per tensor) gets the same positions
    twin = Layout(dp=Shard(0), cp=HeadTail(1), tp=Shard(2))
    coords = {"dp": 1, "cp": 0, "tp": 0}
    assert [ix.tolist() for ix in twin.indices((4, 8, 6), coords, sizes)] == [[2, 3], [0, 1, 6, 7], [0, 1, 2]]
