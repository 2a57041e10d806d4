"""`RankContext`: what a case's run, properties, comm contract and output checks may ask about the rank they run on."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from shardcheck.harness.core.layout import REPLICATED, Layout, Tensors
from shardcheck.harness.core.topology import MESH_DIMS, Topology, data_mesh, mesh_dims


@dataclass
class RankContext:
    """What `Case.run` (and a case's properties, comm contract and output checks) may ask about the rank it
    runs on: the mesh and its groups (`group("tp")`, `rank("tp")`, `size("tp")`; "ep" and "edp": the expert-parallel
    and expert-data-parallel parts of dp, harness/core/topology.py), the topology, the dtype the
    inputs come in, the case's `params`, and the full shape and range of each input's local piece."""

    mesh: DeviceMesh
    topology: Topology
    device: torch.device
    dtype: torch.dtype
    full_shapes: dict[str, tuple[int, ...]]
    input_layouts: dict[str, Layout]
    impl: ModuleType | None = None  # the module under test, for properties that call the op again
    full_inputs: Tensors | None = None  # the full inputs (what index rules such as PackedHeadTail read)
    params: dict = field(default_factory=dict)  # the case's params: a run shared by many cases reads its own here
    # What a run keeps open until its item's backward has run (`keep_open`); the harness closes it.
    contexts: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    kept_open: bool = False
    # {family: its module under test} of the families the case `uses` (resolved as each family's own suite's)
    modules: dict[str, Any] = field(default_factory=dict)
    # Where a run makes its outputs one at a time (a model case's hooks), it may hand each one here as it comes:
    # judge_output(name, local tensor, layout) is True when the harness judged it at once (the run then keeps
    # nothing of it and returns None in its place), False when the run must return it as usual.  None: no such
    # judge (a benchmark's run): the run returns every output.
    judge_output: Callable[[str, torch.Tensor, Layout], bool] | None = None

    def __post_init__(self):
        # Asked once, here: DeviceMesh builds tensors to find a coordinate, and a case's run asks inside
        # the op's memory measurement (whose peak would then grow with the launch's world size).
        dims = mesh_dims(self.mesh)
        self._groups, self._ranks, self._sizes = dict(dims.groups), dict(dims.coords), dict(dims.sizes)

    def keep_open(self, context) -> Any:
        """Enter `context` and keep it open through the item's backward, as a training loop keeps its train
        context (CP) open through `loss.backward()`.  The harness then runs the backward right after the run,
        closes the context, and only then judges outputs and gradients, outside it."""
        self.kept_open = True
        return self.contexts.enter_context(context)

    def group(self, dim: str) -> torch.distributed.ProcessGroup:
        return self._groups[dim]

    def rank(self, dim: str) -> int:
        return self._ranks[dim]

    def size(self, dim: str) -> int:
        return self._sizes[dim]

    def local_shape(self, input_name: str) -> tuple[int, ...]:
        """Shape of this rank's piece of input `input_name` (CP index rules included)."""
        layout = self.input_layouts.get(input_name, REPLICATED)
        return tuple(len(ix) for ix in layout.mesh_indices(self.full_shapes[input_name], self.mesh, self.full_inputs))

    def local_range(self, input_name: str, dim: int) -> tuple[int, int]:
        """Global [start, end) of this rank's piece of input `input_name` along `dim`."""
        return self.input_layouts[input_name].local_range(self.full_shapes[input_name], dim, self.mesh)

    def data_mesh(self) -> DeviceMesh:
        """This rank's dp group as HSDP's 2-D mesh, dims ("dp_replicate", "dp_shard"), shard innermost:
        `fully_shard(model, mesh=ctx.data_mesh())` replicates over the first and shards over the second.  Only at a
        topology that splits dp (`--topology dp=4,dp_replicate=2`; the case says `hsdp=True`)."""
        mesh = data_mesh(self.mesh)
        if mesh is None:
            raise ValueError(
                f"ctx.data_mesh(): topology {self.topology} does not split dp replicate x shard; run the case at "
                "e.g. --topology dp=4,dp_replicate=2"
            )
        return mesh

    def coords(self) -> dict[str, int]:
        """This rank's (dp, cp, tp) coordinates (its ep and edp ones: `rank("ep")`, `rank("edp")`)."""
        return {d: self._ranks[d] for d in MESH_DIMS}

    def module(self, family: str) -> Any:
        """Another family's module under test, resolved as that family's own suite resolves it: `--impl
        FAMILY=SPEC`, else its default (`shardcheck.distributed_impl.<family>`).  The case names it in `uses`."""
        if family not in self.modules:
            raise KeyError(f"family {family!r} is not among the case's uses={tuple(self.modules)}: add it there")
        return self.modules[family]
