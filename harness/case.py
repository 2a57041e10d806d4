"""What a suite declares about one case of one op.

A suite (suites/<family>.py) returns a list of `Case`.  Each case says how to make
the full inputs, how to call the single-device reference on them, how to call the
implementation under test on one rank's local inputs, and how every input and output
is laid out over the ("dp", "cp", "tp") mesh.  The harness does the rest: slicing,
golden values and gradients, comparison on every rank, records.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from harness.topology import MESH_DIMS, Topology

Tensors = dict[str, torch.Tensor]


class Layout:
    """How a full tensor maps to each rank's local tensor: one DTensor placement per mesh dim.

    `Partial()` on a dim means the full value is the *sum* of the ranks' local values
    there (e.g. per-DP-rank losses normalised by the global token count): the harness
    sums them before comparing, and every rank gets the full upstream gradient.
    """

    def __init__(self, dp: Placement | None = None, cp: Placement | None = None, tp: Placement | None = None):
        self.placements = tuple(p if p is not None else Replicate() for p in (dp, cp, tp))

    def __repr__(self) -> str:
        return "Layout(" + ", ".join(f"{d}={p}" for d, p in zip(MESH_DIMS, self.placements)) + ")"

    def _normalized(self, ndim: int) -> list[Placement]:
        # DTensor wants non-negative shard dims; a Partial sum's pieces each see the full upstream gradient.
        return [Shard(p.dim % ndim) if isinstance(p, Shard) else Replicate() if isinstance(p, Partial) else p
                for p in self.placements]

    def reduce_partial(self, local: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        """Sum the local values over the Partial dims (a no-op without any), in float64 so the
        harness's own sum adds no rounding to what is judged."""
        if not any(isinstance(p, Partial) for p in self.placements):
            return local
        placements = [Shard(p.dim % local.ndim) if isinstance(p, Shard) else p for p in self.placements]
        dtensor = DTensor.from_local(local.detach().double(), mesh, placements, run_check=False)
        return dtensor.redistribute(mesh, self._normalized(local.ndim)).to_local()

    def local(self, full: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        """This rank's piece of `full` (no communication: every rank holds the same full tensor)."""
        dtensor = distribute_tensor(full, mesh, self._normalized(full.ndim), src_data_rank=None)
        return dtensor.to_local()

    def global_index(self, local_index: Sequence[int], full_shape: Sequence[int], mesh: DeviceMesh) -> tuple[int, ...]:
        _, offset = compute_local_shape_and_global_offset(torch.Size(full_shape), mesh, self._normalized(len(full_shape)))
        return tuple(int(i) + int(o) for i, o in zip(local_index, offset))

    def local_range(self, full_shape: Sequence[int], dim: int, mesh: DeviceMesh) -> tuple[int, int]:
        """[start, end) of this rank's piece along `dim` in global coordinates."""
        shape, offset = compute_local_shape_and_global_offset(torch.Size(full_shape), mesh, self._normalized(len(full_shape)))
        dim %= len(full_shape)
        return int(offset[dim]), int(offset[dim]) + int(shape[dim])


REPLICATED = Layout()


def as_tuple(out) -> tuple:
    """An op's result as a tuple of outputs."""
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def is_float(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


@dataclass
class Property:
    """Result of a `property:<name>` check on one rank."""

    name: str
    passed: bool
    value: float | None = None
    message: str = ""


@dataclass
class RankContext:
    """What `Case.run` may ask about the rank it runs on."""

    mesh: DeviceMesh
    topology: Topology
    device: torch.device
    dtype: torch.dtype
    full_shapes: dict[str, tuple[int, ...]]
    input_layouts: dict[str, Layout]
    impl: ModuleType | None = None  # the module under test, for properties that call the op again

    def group(self, dim: str) -> torch.distributed.ProcessGroup:
        return self.mesh[dim].get_group()

    def rank(self, dim: str) -> int:
        return self.mesh[dim].get_local_rank()

    def size(self, dim: str) -> int:
        return self.mesh[dim].size()

    def local_range(self, input_name: str, dim: int) -> tuple[int, int]:
        """Global [start, end) of this rank's piece of input `input_name` along `dim`."""
        return self.input_layouts[input_name].local_range(self.full_shapes[input_name], dim, self.mesh)

    def coords(self) -> dict[str, int]:
        return {d: self.rank(d) for d in MESH_DIMS}


# run(impl_module, ctx, local_inputs) -> output tensor or tuple of output tensors
RunFn = Callable[[ModuleType, RankContext, Tensors], Any]
# properties(ctx, full_inputs, local_inputs, local_outputs) -> list of Property
PropertiesFn = Callable[[RankContext, Tensors, Tensors, tuple], list[Property]]
# comparator for one output: (got_local, golden_local, full_inputs, local_inputs, ctx) -> (passed, message)
OutputCheck = Callable[[torch.Tensor, torch.Tensor, Tensors, Tensors, RankContext], tuple[bool, str]]


@dataclass
class Case:
    op: str  # "family.Name": Name must exist in the module under test
    case_id: str  # unique within the op
    make_inputs: Callable[[torch.Generator], Tensors]  # full inputs; floats in float64
    reference: Callable[[Tensors], Any]  # full inputs -> full output(s)
    run: RunFn
    input_layouts: dict[str, Layout] = field(default_factory=dict)  # absent = replicated
    output_layouts: tuple[Layout, ...] = (REPLICATED,)
    output_names: tuple[str, ...] = ("out",)
    grad_inputs: tuple[str, ...] = ()  # inputs whose gradients are checked
    # Mesh dims along which each rank's output is a separate summand of the loss
    # (e.g. a CP all-gather used by every CP rank): each rank then gets its own
    # upstream gradient and the golden gradient is that of the sum.
    summed_over: tuple[str, ...] = ()
    params: dict = field(default_factory=dict)  # recorded as-is
    output_checks: dict[str, OutputCheck] = field(default_factory=dict)  # replaces the numeric forward check
    properties: PropertiesFn | None = None
    raises: type[BaseException] | None = None  # the op must raise this on every rank
    # Communication contract: ctx -> {"forward"|"backward": {"<kind>@<mesh dim>": (max calls, max bytes)}}
    # per rank; doing more (or a kind/dim not listed) fails `property:comm`.
    comm: Callable[[RankContext], dict] | None = None
    dtypes: tuple[str, ...] = ("float64", "float32", "bfloat16")
    supports: Callable[[Topology], bool] = lambda topology: True
    # Whether the case exercises the CP axis.  None: derived from the layouts (something is
    # sharded over "cp", or the outputs are summands over it).  A case that does not would run
    # the same computation on every CP rank, so topologies with cp > 1 skip it.  Ops that shard
    # over CP by themselves (full inputs in, e.g. cp_utils' context) say True.
    context_parallel: bool | None = None

    def runs_on(self, topology: Topology) -> bool:
        """Whether the plan gives this case `topology`."""
        if topology.cp > 1 and not self.uses_cp:
            return False
        return self.supports(topology)

    @property
    def uses_cp(self) -> bool:
        if self.context_parallel is not None:
            return self.context_parallel
        layouts = [*self.input_layouts.values(), *self.output_layouts]
        return "cp" in self.summed_over or any(not isinstance(lay.placements[1], Replicate) for lay in layouts)

    @property
    def family(self) -> str:
        return self.op.split(".", 1)[0]

    @property
    def name(self) -> str:
        return self.op.split(".", 1)[1]
