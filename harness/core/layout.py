"""How a full tensor maps to each rank's piece over the ("dp", "cp", "tp") mesh: `Layout`, one placement per mesh dim,
and one over "ep", the expert-parallel part of dp (Layout(ep=Shard(0)): experts split over ep, replicated over edp).

A placement is torch's DTensor placement (`Shard`, `Replicate`, `Partial`) or one of the CP index rules here
(`HeadTail`, `PackedHeadTail`, `Permuted`) that no DTensor placement expresses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from shardcheck.harness.core.topology import MESH_DIMS, mesh_dims

Tensors = dict[str, torch.Tensor]  # named tensors: a case's inputs, full or one rank's pieces

# Layout._positions's keeping: (placements, full shape, coordinates, sizes) -> (positions per dim, the dims cut), for
# shapes whose dims add up to at most _KEPT_LENGTH (a benchmark's long dims are not kept), at most _KEPT_MAX of them.
_KEPT: dict[tuple, tuple] = {}
_KEPT_MAX = 4096
_KEPT_LENGTH = 1 << 16


@dataclass(frozen=True)
class HeadTail:
    """Load-balanced ("head-tail") CP layout of tensor dim `dim`: the positions are split into
    2·n equal chunks and rank r of n holds chunk r followed by chunk 2·n−1−r (cp=2, 16
    positions: rank 0 holds 0–3 and 12–15, rank 1 holds 4–11)."""

    dim: int

    def positions(self, length: int, n: int, r: int, inputs: Tensors) -> torch.Tensor:
        return head_tail_positions(length, n, r)


@dataclass(frozen=True)
class PackedHeadTail:
    """The head-tail layout applied to each packed sequence on its own: the sequences' padded
    boundaries are the full offsets in input `boundaries` ([B+1], e.g. cu_seqlens_padded); rank r
    holds its two chunks of every sequence, sequences in order."""

    dim: int
    boundaries: str = "cu_seqlens_padded"

    def positions(self, length: int, n: int, r: int, inputs: Tensors) -> torch.Tensor:
        bounds = [int(b) for b in inputs[self.boundaries]]
        if bounds[0] != 0 or bounds[-1] != length:
            raise ValueError(f"{self.boundaries} {bounds} does not span the {length} positions of dim {self.dim}")
        return torch.cat([a + head_tail_positions(b - a, n, r) for a, b in zip(bounds[:-1], bounds[1:])])


@dataclass(frozen=True)
class Permuted:
    """An explicit CP layout: input `index` ([L], a permutation of the positions) lists the positions
    in the order the ranks hold them; rank r of n holds the r-th contiguous 1/n of that list."""

    dim: int
    index: str = "seq_index"

    def positions(self, length: int, n: int, r: int, inputs: Tensors) -> torch.Tensor:
        order = inputs[self.index].long()
        if sorted(order.tolist()) != list(range(length)) or length % n:
            raise ValueError(f"{self.index} must be a permutation of {length} positions divisible by {n}")
        return order.view(n, length // n)[r]


IndexRule = HeadTail | PackedHeadTail | Permuted


def head_tail_positions(length: int, n: int, r: int) -> torch.Tensor:
    """Positions rank r of n holds in the head-tail layout of `length` positions."""
    if length % (2 * n):
        raise ValueError(f"head-tail layout needs a length divisible by 2·CP = {2 * n}, got {length}")
    chunk = length // (2 * n)
    return torch.cat(
        [torch.arange(r * chunk, (r + 1) * chunk), torch.arange((2 * n - 1 - r) * chunk, (2 * n - r) * chunk)]
    )


class Layout:
    """How a full tensor maps to each rank's local tensor: one placement per mesh dim.

    A placement is a DTensor placement (`Shard(d)`, `Replicate()`, `Partial()`) or an index rule
    (`HeadTail(d)`, `PackedHeadTail(d)`, `Permuted(d)`: CP layouts that are not DTensor
    placements).  Either way a rank's piece is, per tensor dim, a list of global positions (mesh
    dims apply in order dp, cp, tp, each splitting what the previous left): `indices` gives them,
    and slicing, rebuilding and the mismatch's global index all go through it.

    `Partial()` on a dim means the full value is the *sum* of the ranks' local values
    there (e.g. per-DP-rank losses normalised by the global token count): the harness
    sums them before comparing, and every rank gets the full upstream gradient.
    `Partial("avg")`: the full value is their *mean* (each DP rank's loss the mean over its own tokens).

    `ep` (expert parallelism, `Shard(d)` or `Replicate()`) splits dim d over the ep part of dp: rank r of ep holds
    the r-th piece, the same on every rank of its expert-data-parallel group (edp).  With ep sharded, dp's own
    placement applies over the rest of dp, edp (dp = edp x ep, ep innermost).  `Layout(ep=Shard(0))`: experts
    [E, ...] split over ep; `Layout(dp=Shard(1), ep=Shard(0))`: [E, T, ...] rows an ep rank's experts receive from
    the tokens of its edp group; `Layout(dp=Partial(), ep=Shard(0))`: an expert gradient before the edp sync,
    summed over edp alone.
    `placements` stays the (dp, cp, tp) triple; `ep` is its own attribute.
    """

    def __init__(
        self,
        dp: Placement | IndexRule | None = None,
        cp: Placement | IndexRule | None = None,
        tp: Placement | IndexRule | None = None,
        ep: Placement | None = None,
    ):
        self.placements = tuple(p if p is not None else Replicate() for p in (dp, cp, tp))
        self.ep = ep if ep is not None else Replicate()
        if not isinstance(self.ep, Shard | Replicate):
            raise ValueError(f"Layout ep={self.ep}: an ep placement is Shard(d) or Replicate()")
        if isinstance(self.ep, Shard) and isinstance(self.placements[0], IndexRule):
            raise ValueError(f"Layout dp={self.placements[0]}, ep={self.ep}: an index rule over dp does not split")

    def __repr__(self) -> str:
        ep = f", ep={self.ep}" if isinstance(self.ep, Shard) else ""
        return "Layout(" + ", ".join(f"{d}={p}" for d, p in zip(MESH_DIMS, self.placements)) + ep + ")"

    @property
    def has_rules(self) -> bool:
        return any(isinstance(p, IndexRule) for p in self.placements)

    def indices(
        self, full_shape: Sequence[int], coords: dict[str, int], sizes: dict[str, int], inputs: Tensors | None = None
    ) -> list[torch.Tensor]:
        """Per tensor dim, the global positions held by the rank at mesh `coords` (mesh dim sizes
        `sizes`), in local order.  Pure: the driver can map any rank's piece without a mesh."""
        return list(self._positions(full_shape, coords, sizes, inputs)[0])

    def _positions(
        self, full_shape: Sequence[int], coords: dict[str, int], sizes: dict[str, int], inputs: Tensors | None
    ) -> tuple[tuple[torch.Tensor, ...], tuple[tuple[int, torch.Tensor], ...]]:
        """`indices`, and the dims where they are not the whole dim with their positions (what `local` selects),
        kept where no rule reads the inputs: a run slices the same shapes at the same coordinates item after item
        (~145,000 slices in the default run)."""
        shape = tuple(int(n) for n in full_shape)
        dims = (*MESH_DIMS, "ep")
        key = (self.placements, self.ep, shape, *(coords.get(d, 0) for d in dims), *(sizes.get(d, 1) for d in dims))
        found = _KEPT.get(key)
        if found is not None:
            return found
        positions = self._compute_positions(shape, coords, sizes, inputs)
        cuts = tuple((d, ix) for d, ix in enumerate(positions) if not _whole(ix, shape[d]))
        if sum(shape) <= _KEPT_LENGTH and not any(isinstance(p, PackedHeadTail | Permuted) for p in self.placements):
            if len(_KEPT) >= _KEPT_MAX:
                _KEPT.pop(next(iter(_KEPT)))  # the oldest
            _KEPT[key] = positions, cuts
        return positions, cuts

    def _compute_positions(
        self, full_shape: Sequence[int], coords: dict[str, int], sizes: dict[str, int], inputs: Tensors | None
    ) -> tuple[torch.Tensor, ...]:
        ndim = len(full_shape)
        idx = [torch.arange(int(n)) for n in full_shape]
        for d, p in zip(MESH_DIMS, self.placements):
            n, r = self._size_and_coord(d, coords, sizes)
            if isinstance(p, Shard):
                dim = p.dim % ndim
                size, offset = Shard.local_shard_size_and_offset(len(idx[dim]), n, r)
                idx[dim] = idx[dim][offset : offset + size]
            elif isinstance(p, IndexRule) and n > 1:
                dim = p.dim % ndim
                idx[dim] = idx[dim][p.positions(len(idx[dim]), n, r, inputs or {})]
        if isinstance(self.ep, Shard):
            # ep innermost in dp (harness/core/topology.py): a pure mapping needs only the dp coordinate
            n = sizes.get("ep", 1)
            r = coords.get("ep", coords.get("dp", 0) % n)
            dim = self.ep.dim % ndim
            size, offset = Shard.local_shard_size_and_offset(len(idx[dim]), n, r)
            idx[dim] = idx[dim][offset : offset + size]
        return tuple(idx)

    def _size_and_coord(self, d: str, coords: dict[str, int], sizes: dict[str, int]) -> tuple[int, int]:
        """Mesh dim d's size and this rank's coordinate along what the placement splits: dp's is edp's where ep
        is sharded (ep innermost: dp coordinate = edp * ep + ep coordinate)."""
        n, r = sizes.get(d, 1), coords.get(d, 0)
        if d == "dp" and isinstance(self.ep, Shard):
            ep = sizes.get("ep", 1)
            return n // ep, r // ep
        return n, r

    def mesh_indices(
        self, full_shape: Sequence[int], mesh: DeviceMesh, inputs: Tensors | None = None
    ) -> list[torch.Tensor]:
        dims = mesh_dims(mesh)
        return self.indices(full_shape, dims.coords, dims.sizes, inputs)

    def misfit(
        self,
        full_shape: Sequence[int],
        sizes: dict[str, int],
        inputs: Tensors | None = None,
        empty_pieces: Sequence[str] = (),
        uneven_pieces: Sequence[str] = ("dp", "tp"),
    ) -> str:
        """Why this layout cannot lay a tensor of `full_shape` out over a mesh of `sizes`, or "" where it can: an
        index rule the length does not split for (head-tail needs a multiple of 2·CP), a Shard over a mesh dim not
        in `uneven_pieces` that does not split its dim evenly, or a Shard over a mesh dim not in `empty_pieces`
        leaving some rank an empty piece (a dim smaller than the mesh dim).  Pure, like `indices`."""
        uneven = self._uneven_shard(full_shape, sizes, uneven_pieces)
        if uneven:
            return uneven
        # The first and the last rank: torch's Shard gives the last ranks the smallest pieces, and an index rule
        # that cannot split a length fails on every rank.
        for corner in ({d: 0 for d in (*MESH_DIMS, "ep")}, {d: sizes.get(d, 1) - 1 for d in (*MESH_DIMS, "ep")}):
            try:
                idx = self.indices(full_shape, corner, sizes, inputs)
            except (ValueError, KeyError, IndexError, RuntimeError) as exc:
                return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            for d, p in zip(MESH_DIMS, self.placements):
                dim = p.dim % len(full_shape) if isinstance(p, Shard) and full_shape else None
                if dim is not None and d not in empty_pieces and sizes.get(d, 1) > 1 and len(idx[dim]) == 0:
                    return (
                        f"dim {dim} of length {full_shape[dim]} sharded over {d}={sizes[d]} leaves some ranks an "
                        "empty piece, and the case does not test empty pieces"
                    )
        return ""

    def _uneven_shard(self, full_shape: Sequence[int], sizes: dict[str, int], uneven_pieces: Sequence[str]) -> str:
        """Why a Shard over a mesh dim not in `uneven_pieces` gives the ranks pieces of unequal lengths ("" where
        none does): the length it splits is what the mesh dims before it left the first rank."""
        lengths = [int(n) for n in full_shape]
        for d, p in zip(MESH_DIMS, self.placements):
            n = self._size_and_coord(d, {}, sizes)[0]
            if not isinstance(p, Shard | IndexRule) or n == 1 or not full_shape:
                continue
            dim = p.dim % len(full_shape)
            if isinstance(p, Shard) and d not in uneven_pieces and lengths[dim] % n:
                return (
                    f"dim {dim} of length {lengths[dim]} sharded over {d}={n} splits into unequal pieces, and the "
                    f"case does not test unequal pieces over {d}"
                )
            lengths[dim] = -(-lengths[dim] // n)
        n = sizes.get("ep", 1)
        if isinstance(self.ep, Shard) and full_shape and lengths[self.ep.dim % len(full_shape)] % n:
            dim = self.ep.dim % len(full_shape)
            return f"dim {dim} of length {lengths[dim]} does not split over ep={n} (ep must divide it)"
        return ""

    def reduce_partial(self, local: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        """Sum the local values over the Partial dims (a no-op without any), in float64 so the
        harness's own sum adds no rounding to what is judged; over a `Partial("avg")` dim, their mean."""
        if not any(isinstance(p, Partial) for p in self.placements):
            return local
        dims = mesh_dims(mesh)
        group_dims = [d for d, p in zip(MESH_DIMS, self.placements) if isinstance(p, Partial) and dims.sizes[d] > 1]
        if isinstance(self.ep, Shard) and "dp" in group_dims:  # a piece held per ep rank: summed over its edp group
            group_dims = ["edp" if d == "dp" else d for d in group_dims]
        total = local.detach().to(torch.float64, copy=True)  # never the op's own output: all_reduce is in place
        for d in group_dims:
            torch.distributed.all_reduce(total, group=dims.groups[d])
            if _averaged(self.placements[MESH_DIMS.index(d)]):  # Partial("avg"): the mean of the ranks' values
                total /= dims.sizes[d]
        return total

    def local(self, full: torch.Tensor, mesh: DeviceMesh, inputs: Tensors | None = None) -> torch.Tensor:
        """This rank's piece of `full` (no communication: every rank holds the same full tensor)."""
        dims = mesh_dims(mesh)
        out = full
        for d, ix in self._positions(full.shape, dims.coords, dims.sizes, inputs)[1]:
            out = out.index_select(d, ix.to(out.device))
        return out

    def global_index(
        self, local_index: Sequence[int], full_shape: Sequence[int], mesh: DeviceMesh, inputs: Tensors | None = None
    ) -> tuple[int, ...]:
        idx = self.mesh_indices(full_shape, mesh, inputs)
        return tuple(int(ix[i]) for ix, i in zip(idx, local_index))

    def local_range(self, full_shape: Sequence[int], dim: int, mesh: DeviceMesh) -> tuple[int, int]:
        """[start, end) of this rank's piece along `dim` in global coordinates (a contiguous piece)."""
        dim %= len(full_shape)
        placements = [Shard(p.dim % len(full_shape)) if isinstance(p, Shard) else Replicate() for p in self.placements]
        if isinstance(self.ep, Shard) or any(
            isinstance(p, IndexRule) and p.dim % len(full_shape) == dim for p in self.placements
        ):
            ix = self.mesh_indices(full_shape, mesh)[dim]
            if len(ix) and not torch.equal(ix, torch.arange(int(ix[0]), int(ix[0]) + len(ix))):
                raise ValueError(f"dim {dim} of {self} is not a contiguous range on this rank")
            return (int(ix[0]), int(ix[0]) + len(ix)) if len(ix) else (0, 0)
        shape, offset = compute_local_shape_and_global_offset(torch.Size(full_shape), mesh, placements)
        return int(offset[dim]), int(offset[dim]) + int(shape[dim])


def _averaged(p: Placement) -> bool:
    return isinstance(p, Partial) and p.reduce_op == "avg"


def take(full: torch.Tensor, indices: Sequence[torch.Tensor]) -> torch.Tensor:
    """full restricted to the given positions per dim (a copy only where a dim is not whole)."""
    out = full
    for d, ix in enumerate(indices):
        if not _whole(ix, full.shape[d]):
            out = out.index_select(d, ix.to(out.device))
    return out


def _whole(positions: torch.Tensor, length: int) -> bool:
    """Whether `positions` are every position of a dim of `length`, in order."""
    return len(positions) == length and torch.equal(positions, torch.arange(length))


REPLICATED = Layout()
