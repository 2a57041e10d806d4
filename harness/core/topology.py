"""(dp, cp, tp) topologies, with expert parallelism (ep) borrowed from dp, and the DeviceMesh each rank runs them on.

Expert parallelism is laid out as torchtitan and Megatron-Core lay it out: the ep ranks are taken from the
data-parallel ranks (ep divides dp).  The dp group is split into ("edp", "ep"), ep innermost: dp rank d has ep
coordinate d % ep and expert-data-parallel coordinate d // ep.  The `ep` group (ep ranks) holds different experts
and exchanges tokens by all-to-all; the `edp` group (dp / ep ranks) holds the same experts and syncs their
gradients.  A topology with ep = 1 is exactly the (dp, cp, tp) one it always was ("dp2-cp1-tp2"); with ep > 1 its
name carries it after dp: "dp4-ep2-cp1-tp1", and `--topology dp=4,ep=2`.

A topology may also split its data-parallel ranks replicate × shard (HSDP: `fully_shard` on a 2-D mesh):
`dp_replicate` divides dp, `--topology dp=4,dp_replicate=2`, named "dp4r2-cp1-tp1" (a topology with dp_replicate = 1
is named as it always was).  Its ranks' ("dp_replicate", "dp_shard") mesh is `data_mesh(mesh)`, shard innermost (dp
rank d is replicate d // dp_shard, shard d % dp_shard, as torch lays out HSDP's mesh).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shardcheck.harness.core.options import UsageError

if TYPE_CHECKING:  # torch is imported where a mesh is built: the CLI parses topologies before it imports torch
    from torch.distributed.device_mesh import DeviceMesh

MESH_DIMS = ("dp", "cp", "tp")
EXPERT_DIMS = ("ep", "edp")  # dp split into its expert-parallel part and the expert-data-parallel rest


@dataclass(frozen=True, order=True)
class Topology:
    dp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1  # expert parallelism: ranks of dp (ep divides dp) holding different experts
    dp_replicate: int = 1  # HSDP: dp split into dp_replicate x dp_shard (dp_replicate divides dp)

    @property
    def size(self) -> int:
        return self.dp * self.cp * self.tp

    def __str__(self) -> str:
        return topology_name(self.dp, self.cp, self.tp, self.ep, self.dp_replicate)

    @classmethod
    def parse(cls, text: str) -> Topology:
        """`dp=1,cp=1,tp=2`, `dp=4,ep=2`, `dp=4,dp_replicate=2` (missing dims are 1; ep and dp_replicate must divide
        dp)."""
        sizes = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, value = part.partition("=")
            if not sep or name not in (*MESH_DIMS, "ep", "dp_replicate"):
                raise UsageError(
                    f"bad topology {text!r}: expected e.g. dp=1,cp=1,tp=2, dp=4,ep=2 or dp=4,dp_replicate=2"
                )
            try:
                sizes[name] = int(value)
            except ValueError:
                raise UsageError(f"bad topology {text!r}: {name} must be an integer") from None
            if sizes[name] <= 0:
                raise UsageError(f"bad topology {text!r}: {name} must be positive, got {sizes[name]}")
        topology = cls(**sizes)
        if topology.dp % topology.ep:
            raise UsageError(
                f"bad topology {text!r}: ep={topology.ep} must divide dp={topology.dp} (the expert-parallel ranks "
                "are taken from the data-parallel ones)"
            )
        if topology.dp % topology.dp_replicate:
            raise UsageError(
                f"bad topology {text!r}: dp_replicate={topology.dp_replicate} must divide dp={topology.dp} (HSDP "
                "splits the data-parallel ranks replicate x shard)"
            )
        return topology


def topology_name(dp: int, cp: int, tp: int, ep: int = 1, dp_replicate: int = 1) -> str:
    """ "dp2-cp1-tp2"; "dp4-ep2-cp1-tp1" where ep > 1, "dp4r2-cp1-tp1" where dp_replicate > 1 (a row's topology, as
    every report names it)."""
    return (
        f"dp{dp}"
        + (f"r{dp_replicate}" if dp_replicate != 1 else "")
        + (f"-ep{ep}" if ep != 1 else "")
        + f"-cp{cp}-tp{tp}"
    )


def topology_label(row: dict) -> str:
    """A result row's topology as Topology names it (a row without ep or dp_replicate, or NaN there: 1)."""

    def size(key: str) -> int:
        value = row.get(key)
        return int(value) if isinstance(value, (int, float)) and value == value else 1

    return topology_name(int(row["dp"]), int(row["cp"]), int(row["tp"]), size("ep"), size("dp_replicate"))


def default_topologies(world_sizes: list[int]) -> list[Topology]:
    """Every (dp, cp, tp) whose size is one of `world_sizes`."""
    out = []
    for w in world_sizes:
        for dp, cp, tp in itertools.product(range(1, w + 1), repeat=3):
            if dp * cp * tp == w:
                out.append(Topology(dp, cp, tp))
    return sorted(set(out), key=lambda t: (t.size, t.tp, t.cp, t.dp))


def expert_topologies(world_sizes: list[int]) -> list[Topology]:
    """The expert-parallel variants of `default_topologies`: each with every ep > 1 dividing its dp.  Only cases
    that declare expert parallelism (Case.expert_parallel) run them."""
    out = [Topology(t.dp, t.cp, t.tp, ep) for t in default_topologies(world_sizes) for ep in range(2, t.dp + 1)]
    return [t for t in out if t.dp % t.ep == 0]


@dataclass(frozen=True)
class MeshDims:
    """Per mesh dim ("dp", "cp", "tp", and dp's parts "ep" and "edp"): its size, this rank's coordinate and its
    process group."""

    sizes: dict[str, int]
    coords: dict[str, int]
    groups: dict[str, Any]


_MESH_DIMS: dict[int, tuple[DeviceMesh, MeshDims]] = {}
_EXPERT_MESHES: dict[int, tuple[DeviceMesh, DeviceMesh]] = {}  # id(mesh) -> (mesh, its ("edp", "ep", "cp", "tp") mesh)
_DATA_MESHES: dict[int, tuple[DeviceMesh, DeviceMesh]] = {}  # id(mesh) -> (mesh, its HSDP data mesh)


def mesh_dims(mesh: DeviceMesh) -> MeshDims:
    """Sizes, coordinates and groups of `mesh`, asked of torch once per mesh: `mesh["tp"]` builds a sub-mesh on
    every call (about a millisecond in torch 2.13), and the harness asks for every tensor it slices."""
    cached = _MESH_DIMS.get(id(mesh))
    if cached is None or cached[0] is not mesh:
        subs = {d: mesh[d] for d in MESH_DIMS}
        experts = _EXPERT_MESHES.get(id(mesh))
        if experts is not None:
            subs.update({d: experts[1][d] for d in EXPERT_DIMS})
        dims = MeshDims(
            sizes={d: m.size() for d, m in subs.items()},
            coords={d: m.get_local_rank() for d, m in subs.items()},
            groups={d: m.get_group() for d, m in subs.items()},
        )
        cached = _MESH_DIMS[id(mesh)] = (mesh, dims)  # the mesh kept alive: its id is never reused
    return cached[1]


def mesh_coords(mesh: DeviceMesh) -> dict[str, int]:
    """This rank's coordinate along each of ("dp", "cp", "tp")."""
    coords = mesh_dims(mesh).coords
    return {d: coords[d] for d in MESH_DIMS}


def named_coords(coords: dict[str, int], topology: Topology) -> dict[str, int]:
    """A rank's (dp, cp, tp) coordinates with dp's parts where `topology` splits dp, right after dp, as failure
    messages name a rank ("dp=3, ep=1, edp=1, cp=0, tp=0"): ep and edp where ep > 1 (dp rank d is ep d % ep, edp
    d // ep), dp_replicate and dp_shard where dp_replicate > 1 (replicate d // dp_shard, shard d % dp_shard)."""
    d = coords["dp"]
    out = {"dp": d}
    if topology.ep > 1:
        out.update(ep=d % topology.ep, edp=d // topology.ep)
    if topology.dp_replicate > 1:
        shard = topology.dp // topology.dp_replicate
        out.update(dp_replicate=d // shard, dp_shard=d % shard)
    return out | {k: v for k, v in coords.items() if k != "dp"}


def expert_mesh(mesh: DeviceMesh) -> DeviceMesh | None:
    """The ("edp", "ep", "cp", "tp") mesh of a mesh `build_mesh` made (dp unflattened, ep innermost): for DTensors
    on `expert_mesh(mesh)["ep"]`.  None for a mesh made elsewhere."""
    experts = _EXPERT_MESHES.get(id(mesh))
    return experts[1] if experts is not None else None


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
    # dp split into (edp, ep), ep innermost (torchtitan's dp_shard_mod_ep x dp_shard_in_ep); at ep = 1 the ep group
    # is each rank alone and edp is dp (a few milliseconds: torch makes the two groups).  dp by its index: torch
    # 2.11's `_unflatten` raises on a dim name that is there (pytorch/pytorch#176443)
    experts = mesh._unflatten(MESH_DIMS.index("dp"), (topology.dp // topology.ep, topology.ep), ("edp", "ep"))
    _EXPERT_MESHES[id(mesh)] = (mesh, experts)  # the mesh kept alive: its id is never reused
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
