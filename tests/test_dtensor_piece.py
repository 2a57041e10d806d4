"""A model case judges an FSDP2 tensor's local piece where it is (harness/core/dtensor_piece.py), without gathering
it: the piece of the golden it is compared with, and where a local element sits in the full tensor, must be torch's
own for FSDP2 over a TP shard (`_StridedShard` on the flattened dp mesh dim, `Shard` on tp) and for plain FSDP2,
uneven pieces included."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from shardcheck.harness.core.dtensor_piece import DTensorPiece
from shardcheck.harness.core.processes import run_ranks


def _pieces(proc) -> list[dict]:
    """On each rank of a 2 x 2 (dp, tp) mesh: a Linear's weight (7 x 5: 7 rows split unevenly) under TP then FSDP2,
    and a plain FSDP2 weight on the dp mesh dim alone; per weight, whether DTensorPiece's piece and indices are torch's
    own local tensor."""
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(7, 5, generator=gen, dtype=torch.float64)
    models = []
    for tp in (True, False):  # the full weight set before sharding: torch lays its pieces out (the reference)
        model = nn.Linear(5, 7, bias=False).double()
        with torch.no_grad():
            model.weight.copy_(full)
        if tp:
            parallelize_module(model, mesh["tp"], ColwiseParallel())
        fully_shard(model, mesh=mesh["dp"])
        models.append(model)
    out = []
    for model in models:
        weight = model.weight
        assert torch.equal(weight.full_tensor(), full)
        piece = DTensorPiece.of(weight)
        local = weight.to_local()
        indices = piece.mesh_indices(full.shape)
        out.append(
            {
                "placements": [type(p).__name__ for p in weight.placements],
                "local_shape": tuple(local.shape),
                "piece_is_torchs": torch.equal(piece.local(full), local),
                "indices_are_torchs": torch.equal(full[indices[0]][:, indices[1]], local),
                "global_index_of_last": piece.global_index([local.shape[0] - 1, 4], full.shape)
                if local.numel()
                else None,
                "a_partial_sum_is_none": DTensorPiece.of(DTensor.from_local(full, mesh["dp"], [Partial()])) is None,
            }
        )
    dist.destroy_process_group()
    return out


def test_an_fsdp2_piece_is_laid_out_as_torch_lays_it_out_without_a_collective():
    run = run_ranks(_pieces, 4, deadline=120, pg_timeout=150)
    assert not run.timed_out and [r.exitcode for r in run.ranks] == [0] * 4, run.describe()
    results = [r.result for r in run.ranks]
    for rank_results in results:
        strided, plain = rank_results
        assert strided["placements"] == ["_StridedShard", "Shard"], strided
        assert plain["placements"] == ["Shard"], plain
        for r in rank_results:
            assert r["piece_is_torchs"] and r["indices_are_torchs"] and r["a_partial_sum_is_none"], r
    # 7 rows over dp 2 (FSDP2: 4 and 3): rank 2 (dp 1) holds rows 4..6 of the plain weight, its last one is row 6
    assert results[2][1]["local_shape"] == (3, 5) and results[2][1]["global_index_of_last"] == (6, 4)
    # the TP-then-FSDP2 pieces: every row held once over the four ranks
    rows = sorted(r[0]["local_shape"][0] for r in results)
    assert sum(rows) == 7, rows
