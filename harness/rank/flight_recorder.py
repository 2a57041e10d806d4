"""The rank side of the collective flight recorder: every collective this rank enters, written as it starts.

PyTorch's flight recorder keeps a ring of each rank's collectives in the rank's memory (gloo's too, in torch 2.13,
with TORCH_FR_BUFFER_SIZE set) and dumps it when asked or on a timeout; a rank killed by SIGKILL or aborted by gloo
dumps nothing, and a rank blocked in C++ runs no Python (no signal handler, no atexit).  So each record is in the
file before the collective starts: LAUNCH_DIR/rank<R>.collectives, a ring of RING fixed slots mapped into memory
(MAP_SHARED).  A record is a store into the kernel's page cache, no system call: the file holds it as soon as it
is written, so a rank killed by SIGKILL or aborted by gloo leaves every record it wrote (what is not kept: the
last records when the machine itself goes down, and, on a filesystem shared between nodes, records not yet written
back when another node reads them: `flush` (msync) does that, the hand-launched watchdog calls it at a hang).  The
driver reads them when a case hangs or a rank dies (shardcheck.harness.driver.flight, `read_records`), and writes
them beside its finding in torch's dump format too, for torch's analyzer `torchfrtrace` (harness/driver/flight_dump.py).
What ours adds to torch's records: the calling line outside torch, the item and mesh dim.

Cheap enough to stay on in every run: the entry points of torch.distributed's collectives and of its functional
collectives (what DTensor's redistributions call) are wrapped, not every aten op (a dispatch mode over every op,
as the communication counter is, costs far more); the calling line is a walk up the frames with what is torch's
cached per code object, the group's name cached per group object, the record one tab-separated line (no JSON).
A record: n, plan, item, group, dim, seq (per group within the item, from 1), kind, shape, dtype, where (the calling
line outside torch).
"""

from __future__ import annotations

import functools
import inspect
import mmap
import os
import sys
from pathlib import Path

RING = 512  # slots: the last RING records are kept
SLOT = 512  # bytes a record may take (a longer calling line is cut)
# SHARDCHECK_FLIGHT_RECORDER=0 in the environment of the run (its ranks inherit it) runs without the recorder: to
# measure its cost, or to rule it out; a hang's finding then has the stacks but no collectives compared.
SWITCH = "SHARDCHECK_FLIGHT_RECORDER"
RECORD_FILE = "collectives"
_FIELDS = 11  # n, plan, item, group, dim, seq, kind, shape, dtype, where, n again (a torn slot's two n differ)

# c10d entry point -> (kind, name of the parameter whose tensor this rank hands over; None: no tensor worth naming)
_C10D = {
    "all_reduce": ("all_reduce", "tensor"),
    "broadcast": ("broadcast", "tensor"),
    "reduce": ("reduce", "tensor"),
    "all_gather": ("all_gather", "tensor"),
    "all_gather_into_tensor": ("all_gather", "input_tensor"),
    "all_gather_single": ("all_gather", "input_tensor"),  # torch 2.13's name (all_gather_into_tensor calls it)
    "_all_gather_base": ("all_gather", "input_tensor"),
    "reduce_scatter": ("reduce_scatter", "output"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter_single": ("reduce_scatter", "input"),  # torch 2.13's name (reduce_scatter_tensor calls it)
    "_reduce_scatter_base": ("reduce_scatter", "input"),
    "all_to_all_single": ("all_to_all", None),
    "all_to_all": ("all_to_all", None),
    "gather": ("gather", "tensor"),
    "scatter": ("scatter", "tensor"),
    "send": ("send", "tensor"),
    "recv": ("recv", "tensor"),
    "isend": ("send", "tensor"),
    "irecv": ("recv", "tensor"),
    "barrier": ("barrier", None),
    "all_gather_object": ("all_gather_object", None),
    "broadcast_object_list": ("broadcast_object_list", None),
    "all_reduce_coalesced": ("all_reduce", None),
}
# functional collectives (torch.distributed._functional_collectives): DTensor's redistributions go through these
_FUNCOL = {
    "all_reduce": ("all_reduce", "self"),
    "all_gather_tensor": ("all_gather", "self"),
    "all_gather_single": ("all_gather", "input"),
    "all_gather_tensor_autograd": ("all_gather", "self"),
    "reduce_scatter_tensor": ("reduce_scatter", "self"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor_autograd": ("reduce_scatter", "self"),
    "all_to_all_single": ("all_to_all", None),
    "all_to_all_single_autograd": ("all_to_all", None),
    "broadcast": ("broadcast", "self"),
    "all_reduce_coalesced": ("all_reduce", None),
    "all_gather_inplace": ("all_gather", None),
}


def enabled() -> bool:
    """Whether this process records its collectives (SWITCH unset, or anything but 0)."""
    return os.environ.get(SWITCH, "1").strip() != "0"


def record_path(launch_dir: Path, rank: int) -> Path:
    return launch_dir / f"rank{rank}.{RECORD_FILE}"


class FlightRecorder:
    """This rank's records (one per launch, kept across its plans)."""

    def __init__(self, launch_dir: Path, rank: int):
        self.path = record_path(launch_dir, rank)
        with open(self.path, "w+b") as fh:
            fh.truncate(RING * SLOT)  # (sparse: slots never written read as zeros)
            self.ring = mmap.mmap(fh.fileno(), RING * SLOT)  # MAP_SHARED: stores land in the file
        self.n = 0  # records so far (slot n % RING; the reader orders the slots by it)
        self.plan: int | None = None
        self.item: int | None = None
        self.seq: dict[str, int] = {}  # group name -> collectives entered on it in this item
        self.dims: dict[str, str] = {}  # group name -> mesh dim ("tp", "dp|cp" for a group the dims share)
        self.inside = False  # a collective calling another (all_gather_object -> all_gather) is one record

    def begin_item(self, plan: int, item: int, dims: dict[str, str]) -> None:
        self.plan, self.item = plan, item
        self.seq.clear()
        self.dims.update(dims)

    def _dim(self, group: str) -> str:
        """A group of no mesh dim: the world's, or one the op made (named once, then kept)."""
        self.dims[group] = "world" if group == _world_name() else f"group {group}"
        return self.dims[group]

    def record(self, kind: str, group: str, tensor, where: str) -> None:
        self.seq[group] = seq = self.seq.get(group, 0) + 1
        n = self.n = self.n + 1
        shape = dtype = ""
        if tensor is not None and hasattr(tensor, "dtype"):
            shape = ",".join(map(str, tensor.shape)) or "-"  # "-": a 0-d tensor ("": no tensor)
            dtype = _DTYPES.get(tensor.dtype) or _dtype_name(tensor.dtype)
        dim = self.dims.get(group) or self._dim(group)
        line = (
            f"{n}\t{self.plan}\t{self.item}\t{group}\t{dim}\t{seq}\t{kind}\t{shape}\t{dtype}\t{where}\t{n}\n"
        ).encode(errors="replace")
        if len(line) > SLOT:  # a calling line too long for its slot: its file's start cut
            head = f"{n}\t{self.plan}\t{self.item}\t{group}\t{dim}\t{seq}\t{kind}\t{shape}\t{dtype}\t".encode()
            tail = f"\t{n}\n".encode()
            room = SLOT - len(head) - len(tail) - 3
            line = head + b"..." + where.encode(errors="replace")[-room:] + tail
        at = (n % RING) * SLOT
        self.ring[at : at + len(line)] = line

    def flush(self) -> None:
        """Write the records back to the file's storage (msync): for readers on other nodes of a shared filesystem."""
        self.ring.flush()


_DTYPES: dict = {}


def _dtype_name(dtype) -> str:
    _DTYPES[dtype] = name = str(dtype).removeprefix("torch.")
    return name


def read_records(launch_dir: Path, rank: int) -> list[dict]:
    """A rank's records (the last RING), in the order it entered them; a slot torn by a death mid-write is left out."""
    try:
        data = record_path(launch_dir, rank).read_bytes()
    except OSError:
        return []
    records = []
    for at in range(0, len(data), SLOT):
        line = data[at : at + SLOT].split(b"\n", 1)[0].decode(errors="replace")
        fields = line.split("\t")
        if len(fields) != _FIELDS or fields[0] != fields[-1]:
            continue
        n, plan, item, group, dim, seq, kind, shape, dtype, where, _ = fields
        try:
            records.append(
                {
                    "n": int(n),
                    "plan": None if plan == "None" else int(plan),
                    "item": None if item == "None" else int(item),
                    "group": group,
                    "dim": dim,
                    "seq": int(seq),
                    "kind": kind,
                    "shape": None if not shape else [] if shape == "-" else [int(d) for d in shape.split(",")],
                    "dtype": dtype or None,
                    "where": where,
                }
            )
        except ValueError:
            continue
    return sorted(records, key=lambda r: r["n"])


_RECORDER: FlightRecorder | None = None
_TORCH_DIR = ""  # frames in torch (and this file) are not "where": the caller's line is
_SKIPPED: dict = {}  # code object -> whether its frames are torch's (or this file's): not "where"
_GROUP_NAMES: dict = {}  # group object (None, a ProcessGroup, a (mesh, dim) pair) -> its name


def _world_name() -> str:
    import torch.distributed as dist

    return dist.group.WORLD.group_name if dist.is_initialized() else ""


def _where() -> str:
    """FILE:LINE FUNCTION of the innermost frame outside torch and this file."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        skip = _SKIPPED.get(code)
        if skip is None:
            skip = _SKIPPED[code] = code.co_filename.startswith((_TORCH_DIR, __file__))
        if not skip:
            return f"{code.co_filename}:{frame.f_lineno} {code.co_name}"
        frame = frame.f_back
    return "?"


def _group_name(group, funcol: bool) -> str:
    if isinstance(group, str):  # a functional collective's group given by name
        return group
    try:
        return _GROUP_NAMES[group]
    except (KeyError, TypeError):  # TypeError: a list of ranks (unhashable), resolved every time
        pass
    import torch.distributed as dist

    if funcol:
        from torch.distributed._functional_collectives import _resolve_group_name

        name = str(_resolve_group_name(group))
    else:
        name = (group or dist.group.WORLD).group_name
    try:  # (None: the world's group, the same for the life of the rank)
        _GROUP_NAMES[group] = name
    except TypeError:
        pass
    return name


def _recorded(fn, kind: str, tensor_param: str | None, funcol: bool):
    params = list(inspect.signature(fn).parameters)
    group_at = params.index("group") if "group" in params else None
    tensor_at = params.index(tensor_param) if tensor_param in params else None

    @functools.wraps(fn)
    def recorded(*args, **kwargs):
        rec = _RECORDER
        if rec is None or rec.inside:
            return fn(*args, **kwargs)
        rec.inside = True
        try:
            try:
                group = kwargs.get("group", args[group_at] if group_at is not None and len(args) > group_at else None)
                tensor = None
                if tensor_at is not None:
                    tensor = kwargs.get(tensor_param, args[tensor_at] if len(args) > tensor_at else None)
                rec.record(kind, _group_name(group, funcol), tensor, _where())
            except Exception:  # the recorder never fails the op it watches
                pass
            return fn(*args, **kwargs)
        finally:
            rec.inside = False

    recorded.__shardcheck_recorded__ = fn
    return recorded


def install(launch_dir: Path, rank: int) -> FlightRecorder:
    """Wrap the collective entry points (once per process) and start this rank's records in `launch_dir`.  Run
    before the modules under test are imported: a `from torch.distributed import all_reduce` then gets the wrapper;
    torch's own modules that imported a collective by name (DTensor's mesh_broadcast) are patched here."""
    global _RECORDER, _TORCH_DIR
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    import torch.distributed.tensor  # noqa: F401  (its modules import collectives by name: patched below)

    _TORCH_DIR = str(Path(torch.__file__).parent) + "/"
    replaced = {}
    for module, table, is_funcol in ((dist.distributed_c10d, _C10D, False), (funcol, _FUNCOL, True)):
        for name, (kind, tensor_param) in table.items():
            fn = getattr(module, name, None)
            if fn is None or hasattr(fn, "__shardcheck_recorded__"):
                continue
            replaced[id(fn)] = (fn, _recorded(fn, kind, tensor_param, is_funcol))
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "torch.distributed" or name.startswith("torch.distributed.")):
            continue
        for attr, value in list(vars(module).items()):
            hit = replaced.get(id(value))
            if hit is not None and hit[0] is value:
                setattr(module, attr, hit[1])
    _RECORDER = FlightRecorder(launch_dir, rank)
    return _RECORDER
