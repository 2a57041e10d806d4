"""(dp, cp, tp) topologies and the DeviceMesh each rank runs them on.

A topology may split its data-parallel ranks replicate × shard (HSDP: `fully_shard` on a 2-D mesh): `dp_replicate`
divides dp, `--topology dp=4,dp_replicate=2`, named "dp4r2-cp1-tp1" (a topology with dp_replicate = 1 is named as it
always was).  Its ranks' ("dp_replicate", "dp_shard") mesh is `data_mesh(mesh)`, shard innermost (dp rank d is
replicate d // dp_shard, shard d % dp_shard, as torch lays out HSDP's mesh)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shardcheck.harness.core.options import UsageError

if TYPE_CHECKING:  # torch is imported where a mesh is built: the CLI parses topologies before it imports torch
    from torch.distributed.device_mesh import DeviceMesh

MESH_DIMS = ("dp", "cp", "tp")


@dataclass(frozen=True, order=True)
class Topology:
    dp: int = 1
    cp: int = 1
    tp: int = 1
    dp_replicate: int = 1  # HSDP: dp split into dp_replicate x dp_shard (dp_replicate divides dp)

    @property
    def size(self) -> int:
        return self.dp * self.cp * self.tp

    def __str__(self) -> str:
        return (
            f"dp{self.dp}" + (f"r{self.dp_replicate}" if self.dp_replicate != 1 else "") + f"-cp{self.cp}-tp{self.tp}"
        )

    @classmethod
    def parse(cls, text: str) -> Topology:
        """`dp=1,cp=1,tp=2`, `dp=4,dp_replicate=2` (missing dims are 1; dp_replicate must divide dp)."""
        sizes = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, value = part.partition("=")
            if not sep or name not in (*MESH_DIMS, "dp_replicate"):
                raise UsageError(f"bad topology {text!r}: expected e.g. dp=1,cp=1,tp=2 or dp=4,dp_replicate=2")
            try:
                sizes[name] = int(value)
            except ValueError:
                raise UsageError(f"bad topology {text!r}: {name} must be an integer") from None
            if sizes[name] <= 0:
                raise UsageError(f"bad topology {text!r}: {name} must be positive, got {sizes[name]}")
        topology = cls(**sizes)
        if topology.dp % topology.dp_replicate:
            raise UsageError(
                f"bad topology {text!r}: dp_replicate={topology.dp_replicate} must divide dp={topology.dp} (HSDP "
                "splits the data-parallel ranks replicate x shard)"
            )
        return topology


def topology_label(row: dict) -> str:
    """A result row's topology as Topology names it ("dp4r2-cp1-tp1"; a row without dp_replicate, or NaN: 1)."""
    replicate = row.get("dp_replicate")
    replicate = int(replicate) if isinstance(replicate, (int, float)) and replicate == replicate else 1
    return str(Topology(int(row["dp"]), int(row["cp"]), int(row["tp"]), replicate))


def default_topologies(world_sizes: list[int]) -> list[Topology]:
    """Every (dp, cp, tp) whose size is one of `world_sizes`."""
    out = []
    for w in world_sizes:
        for dp, cp, tp in itertools.product(range(1, w + 1), repeat=3):
            if dp * cp * tp == w:
                out.append(Topology(dp, cp, tp))
    return sorted(set(out), key=lambda t: (t.size, t.tp, t.cp, t.dp))


@dataclass(frozen=True)
class MeshDims:
    """Per mesh dim ("dp", "cp", "tp"): its size, this rank's coordinate and its process group."""

    sizes: dict[str, int]
    coords: dict[str, int]
    groups: dict[str, Any]


_MESH_DIMS: dict[int, tuple[DeviceMesh, MeshDims]] = {}
_DATA_MESHES: dict[int, tuple[DeviceMesh, DeviceMesh]] = {}  # id(mesh) -> (mesh, its HSDP data mesh)


def mesh_dims(mesh: DeviceMesh) -> MeshDims:
    """Sizes, coordinates and groups of `mesh`, asked of torch once per mesh: `mesh["tp"]` builds a sub-mesh on
    every call (about a millisecond in torch 2.13), and the harness asks for every tensor it slices."""
    cached = _MESH_DIMS.get(id(mesh))
    if cached is None or cached[0] is not mesh:
        subs = {d: mesh[d] for d in MESH_DIMS}
        dims = MeshDims(
            sizes={d: m.size() for d, m in subs.items()},
            coords={d: m.get_local_rank() for d, m in subs.items()},
            groups={d: m.get_group() for d, m in subs.items()},
        )
        cached = _MESH_DIMS[id(mesh)] = (mesh, dims)  # the mesh kept alive: its id is never reused
    return cached[1]


def mesh_coords(mesh: DeviceMesh) -> dict[str, int]:
    """This rank's coordinate along each of ("dp", "cp", "tp")."""
    return dict(mesh_dims(mesh).coords)


def build_mesh(topology: Topology, world_size: int, device_type: str) -> DeviceMesh:
    """The ("dp", "cp", "tp") sub-mesh of this rank.

    Collective: every rank of the world calls it.  The world is split into
    world_size // size replicas of the topology; replica 0 runs the case, the
    others wait (on a 2-core machine idle ranks leave the cores to the busy ones).
    """
    if world_size % topology.size:
        raise UsageError(f"topology {topology} (size {topology.size}) does not divide world size {world_size}")
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.arange(world_size).view(world_size // topology.size, topology.dp, topology.cp, topology.tp)
    full = DeviceMesh(device_type, ranks, mesh_dim_names=("replica",) + MESH_DIMS)
    mesh = full[MESH_DIMS]
    if topology.dp_replicate > 1:  # HSDP's 2-D data mesh: built here, as every rank of the world must build it
        shard = topology.dp // topology.dp_replicate
        split = ranks.view(world_size // topology.size, topology.dp_replicate, shard, topology.cp, topology.tp)
        names = ("replica", "dp_replicate", "dp_shard") + MESH_DIMS[1:]
        data = DeviceMesh(device_type, split, mesh_dim_names=names)[("dp_replicate", "dp_shard")]
        _DATA_MESHES[id(mesh)] = (mesh, data)  # the mesh kept alive: its id is never reused
    return mesh


def data_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The ("dp_replicate", "dp_shard") mesh of this rank's dp group where its topology splits dp (HSDP), else None."""
    found = _DATA_MESHES.get(id(mesh))
    return found[1] if found is not None and found[0] is mesh else None
