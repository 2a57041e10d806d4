"""What an op costs on one rank: time, peak memory, collectives.

- Communication: a TorchDispatchMode sees every c10d / functional collective (torch routes
  them through the dispatcher), those DTensor issues inside its ops included; torch's
  CollectiveOp helper gives the process group.  Counted
  per collective kind and mesh dim; bytes are those this rank *sends*: the elements of the
  tensors it hands over (a view counts its own elements, not its base's; an all-gather its
  own piece, not the gathered output).
- Memory on CPU: peak bytes of the *storages* this rank allocates above what existed before, tracked by
  storage (allocation and release through weak references), so the same code on the same shapes gives the same
  number on every run.  A DTensor op is followed down to the ops on its local tensors: what counts is the local
  storage a rank really holds, never the global shape of DTensor's wrapper; a view, an in-place op or a second
  tensor on the same storage counts once.  A tensor handed to a collective (sent or received) stops counting at
  that call: the backend's worker thread drops its reference at a moment no program controls, which would make
  the peak vary from run to run (an all-gather's output counts through what the op makes of it: DTensor's
  `full_tensor()` copies it once more).  On CUDA: the allocator's peak above the baseline.
- Time: the caller brackets iterations with barriers; CUDA events on GPU.
"""

from __future__ import annotations

import importlib.util
import time
import weakref
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from shardcheck.harness.core.records import Phase
from shardcheck.harness.core.topology import EXPERT_DIMS, MESH_DIMS, mesh_dims


def _fake_collectives():
    """torch's `torch.distributed._tools.fake_collectives` (the collective ops, and the helper that finds their
    process group), loaded from its file alone: importing it by name first runs its package's __init__, which
    imports the memory and runtime estimators and, through them, inductor: about 0.5 s in every process of a
    run (the driver and each rank) for a module that needs none of it."""
    path = Path(torch.distributed.__file__).parent / "_tools" / "fake_collectives.py"
    spec = importlib.util.spec_from_file_location("shardcheck_torch_fake_collectives", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_fake = _fake_collectives()
CollectiveOp, collective_ops = _fake.CollectiveOp, _fake.collective_ops

# c10d ops whose first argument is the output buffer: what this rank sends is the second.
_SENDS_ARG1 = {
    "_allgather_base_",
    "allgather_",
    "allgather_coalesced_",
    "allgather_into_tensor_coalesced_",
    "alltoall_base_",
    "alltoall_",
    "_reduce_scatter_base_",
    "reduce_scatter_",
    "reduce_scatter_tensor_coalesced_",
    "gather_",
    "scatter_",
}


def sent_bytes(func, args) -> int:
    """Bytes of the tensors this rank hands to the collective `func`."""
    sent = args[1] if func.namespace == "c10d" and func._overloadpacket.__name__ in _SENDS_ARG1 else args[0]
    return sum(t.numel() * t.element_size() for t in tree_leaves(sent) if isinstance(t, torch.Tensor))


_NOT_COUNTED = {"wait_tensor", "barrier", "monitored_barrier"}
_KIND = {  # dispatcher op name -> collective kind
    "allreduce": "all_reduce",
    "all_reduce": "all_reduce",
    "allreduce_coalesced": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "_allgather_base": "all_gather",
    "allgather": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "allgather_coalesced": "all_gather",
    "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall_base": "all_to_all",
    "alltoall": "all_to_all",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "gather": "gather",
    "scatter": "scatter",
    "send": "send",
    "recv": "recv",
    "recv_any_source": "recv",
}


def collective_kind(func) -> str | None:
    name = func._overloadpacket.__name__.rstrip("_")  # c10d's in-place ops end in "_"
    return None if name in _NOT_COUNTED else _KIND.get(name, name)


class CommCounter(TorchDispatchMode):
    """Counts collectives: {phase: {"<kind>@<mesh dim>": {"calls": n, "bytes": b}}}.

    bytes = the tensor bytes this rank hands to the collective (its contribution).  `enabled=False`: entering
    it does nothing (a case without a communication contract: a dispatch mode costs every op of the run tens
    of microseconds, and the op under test runs as it would without the harness)."""

    def __init__(self, group_dims: dict[str, str], enabled: bool = True):
        super().__init__()
        self.enabled = enabled
        self.group_dims = group_dims  # process group name -> mesh dim
        self.phase = Phase.FORWARD
        self.counts: dict[str, dict[str, dict[str, int]]] = defaultdict(
            lambda: defaultdict(lambda: {"calls": 0, "bytes": 0})
        )

    def __enter__(self):
        return super().__enter__() if self.enabled else self

    def __exit__(self, *exc_info):
        if self.enabled:
            return super().__exit__(*exc_info)
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # A DTensor op: DTensor then dispatches it with this mode still active, so the collectives it
        # issues on local tensors (a redistribution, torch's CP ring attention) are counted too.
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in collective_ops:
            kind = collective_kind(func)
            if kind is not None:
                try:
                    group = CollectiveOp.get_process_group(func, args)
                    dim = self.group_dims.get(group.group_name, "other")
                except Exception:  # an op torch's helper does not know: still count it
                    dim = "other"
                nbytes = sent_bytes(func, args)
                entry = self.counts[self.phase][f"{kind}@{dim}"]
                entry["calls"] += 1
                entry["bytes"] += int(nbytes)
        return out

    def as_dict(self, allowed: dict | None = None) -> dict:
        """The counts.  A collective on a group that several mesh dims share (in a 1-rank world every dim is the
        default group) is counted under the first of them the contract `allowed` lists for its kind, else the first."""
        out: dict = {}
        for phase, kinds in self.counts.items():
            for key, seen in kinds.items():
                kind, _, dims = key.partition("@")
                options = dims.split("|")
                listed = [d for d in options if f"{kind}@{d}" in (allowed or {}).get(phase, {})]
                entry = out.setdefault(phase, {}).setdefault(
                    f"{kind}@{(listed or options)[0]}", {"calls": 0, "bytes": 0}
                )
                entry["calls"] += seen["calls"]
                entry["bytes"] += seen["bytes"]
        return {phase: dict(sorted(kinds.items())) for phase, kinds in out.items()}


class LiveBytes(TorchDispatchMode):
    """Peak bytes of tensor storages allocated inside the mode and still alive (CPU memory), per storage."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._alive: dict[int, weakref.ref] = {}

    def _free(self, key: int, nbytes: int, _ref) -> None:
        if self._alive.pop(key, None) is not None:
            self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # A DTensor (any wrapper subclass) op: its own __torch_dispatch__ then runs the op on the local tensors with
        # this mode still active, so the storages those allocate are what counts, not the wrapper's global shape.
        if any(issubclass(t, DTensor) or hasattr(t, "__tensor_flatten__") for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in collective_ops:  # the backend owns these buffers from here on (see module doc)
            for storage in _storages(tree_leaves((args, out))).values():
                self._forget(storage)
            return out
        # Views, in-place ops and detach() hand back an input's storage: not an allocation.
        inputs = _storages(tree_leaves((args, kwargs)))
        for key, storage in _storages(tree_leaves(out)).items():
            if key not in inputs:
                self._track(key, storage)
        return out

    def _track(self, key: int, storage) -> None:
        if key in self._alive:
            return
        nbytes = storage.nbytes()
        self._alive[key] = weakref.ref(storage, lambda ref, k=key, n=nbytes: self._free(k, n, ref))
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def _forget(self, storage) -> None:
        if self._alive.pop(storage._cdata, None) is not None:
            self.live -= storage.nbytes()


def _storages(leaves) -> dict[int, torch.UntypedStorage]:
    """The storages of the plain tensors among `leaves`, by identity (a storage shared by views once)."""
    # A fake tensor (DTensor's sharding propagation runs ops on them) reports a device but holds a meta storage.
    storages = (
        t.untyped_storage()
        for t in leaves
        if isinstance(t, torch.Tensor) and not hasattr(type(t), "__tensor_flatten__")
    )
    return {s._cdata: s for s in storages if s.device.type != "meta"}


@contextmanager
def peak_memory(device: torch.device):
    """Yields a dict that holds 'peak_bytes' above the baseline once the block ends."""
    result = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield result
        torch.cuda.synchronize(device)
        result["peak_bytes"] = torch.cuda.max_memory_allocated(device) - base
    else:
        with LiveBytes() as tracker:
            yield result
        result["peak_bytes"] = tracker.peak


class Timer:
    """Wall time of a block in milliseconds: CUDA events on GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.device = device

    @contextmanager
    def __call__(self, into: list):
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            end.synchronize()
            into.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            yield
            into.append((time.perf_counter() - t0) * 1e3)


def group_dims(mesh) -> dict[str, str]:
    """Process group name -> mesh dim name, to attribute each collective to a mesh dim ("dp|cp|tp" for a group
    the dims share: torch gives a dim that spans the whole world the default group)."""
    shared: dict[str, list[str]] = {}
    groups = mesh_dims(mesh).groups
    world = torch.distributed.distributed_c10d._get_default_group()
    for d in MESH_DIMS:
        shared.setdefault(groups[d].group_name, []).append(d)
        if groups[d].group_name != world.group_name and groups[d].size() == world.size():
            # torch 2.11 gave a dim spanning the world a group of its own (seen on a GPU machine): code that talks
            # on the default group talks over that dim all the same
            shared.setdefault(world.group_name, []).append(d)
    for d in EXPERT_DIMS:  # ep and edp where they are groups of their own (not dp's, nor the world's)
        if d in groups and groups[d].group_name not in shared:
            shared[groups[d].group_name] = [d]
    return {name: "|".join(dims) for name, dims in shared.items()}


def comm_violations(observed: dict, allowed: dict) -> list[str]:
    """Where the observed collectives exceed the contract (calls or bytes, per phase, kind and dim)."""
    out = []
    for phase, kinds in observed.items():
        for key, seen in kinds.items():
            max_calls, max_bytes = allowed.get(phase, {}).get(key, (0, 0))
            if seen["calls"] > max_calls or seen["bytes"] > max_bytes:
                out.append(
                    f"{phase} {key}: {seen['calls']} call(s), {seen['bytes']} B "
                    f"> allowed {max_calls} call(s), {max_bytes} B"
                )
    return out


def split_comm(observed: dict) -> tuple[dict, dict]:
    """(comm_calls, comm_bytes) as {phase: {"<kind>@<dim>": n}} for the records."""
    calls = {p: {k: v["calls"] for k, v in kinds.items()} for p, kinds in observed.items()}
    nbytes = {p: {k: v["bytes"] for k, v in kinds.items()} for p, kinds in observed.items()}
    return calls, nbytes
