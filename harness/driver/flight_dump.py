"""The ranks' flight records of a hung or dead case in PyTorch's flight recorder dump format, for its analyzer.

torch's analyzer (`torchfrtrace DIR`, or `python -m torch.distributed.flight_recorder.fr_trace DIR`) reads one
pickled dump per rank (a dict: version, pg_config, pg_status, entries) from files named PREFIX<rank>, matches the
ranks' entries on each process group by their sequence number, and reports the first collective a rank did not
join or joined with other sizes or another kind.  Our records are written before each collective starts, from a
ring mapped into a file (harness/rank/flight_recorder.py), so a rank killed by SIGKILL or aborted by gloo has
them; torch's own recorder lives in the rank's memory, and in torch 2.13 its gloo dump names no process group in
pg_config (the analyzer stops at KeyError).  So the driver writes every participant's records of the case in
torch's format here, from what it already read: one dump per rank, a rank with no records an empty one (the
analyzer then names it missing).

What torch's format has no field for, our records carry in extra keys the analyzer ignores (`where`, `item`,
`dim`); each record's calling line is also its one frame.  What ours do not know is left out or derived: the
output sizes (one tensor is recorded: all_gather's output is the group's pieces along dim 0), the times (None),
the state (every record is "scheduled": it is written before the collective starts).  A send or recv is left
out: our records do not name its peer, which torch's entry needs ("send 0->1").
"""

from __future__ import annotations

import pickle
from pathlib import Path

from shardcheck.harness.driver.flight import members

VERSION = "2.10"  # the dump format torch 2.13 writes (the analyzer picks its matching rules by it)
FOLDER = "torch-flight-recorder"  # in failures/<item>/: only the dumps (the analyzer reads every file it holds)
PREFIX = "rank_"  # a dump's file name: PREFIX<rank>
_P2P = {"send", "recv"}
# our kinds that torch's analyzer does not know, as the collective they are made of
_TORCH_KIND = {"all_gather_object": "all_gather", "broadcast_object_list": "broadcast"}


def _groups(records: dict[int, list[dict]], topology: tuple[int, int, int]) -> dict[int, dict[str, list[int]]]:
    """Each rank's groups and their global ranks: a mesh dim's ranks from the topology (the rank's own group along
    it: the groups along one dim may share a name); a group the op made, the ranks that used it."""
    dims = {rec["group"]: rec["dim"] for recs in records.values() for rec in recs}
    users: dict[str, set[int]] = {}
    for rank, recs in records.items():
        for rec in recs:
            users.setdefault(rec["group"], set()).add(rank)
    groups: dict[int, dict[str, list[int]]] = {}
    for rank in records:
        along = {group: members(dim, rank, topology) or sorted(users[group]) for group, dim in dims.items()}
        groups[rank] = {group: ranks for group, ranks in along.items() if rank in ranks}
    return groups


def _sizes(kind: str, shape: list[int] | None, group_size: int) -> tuple[list, list]:
    """(input_sizes, output_sizes) of one record, as torch's analyzer compares them."""
    tensor = list(shape) if shape is not None else []
    if kind == "all_gather":  # the group's pieces, stacked along dim 0
        return [tensor], [[group_size * tensor[0], *tensor[1:]] if tensor else [group_size]]
    # (recorded: the tensor reduced, each rank keeping its piece along dim 0; c10d's list form records its output,
    # so its sizes here are the group's size too small, alike on every rank: a mismatch between ranks still shows)
    if kind == "reduce_scatter":
        return [tensor or [group_size]], [[tensor[0] // group_size, *tensor[1:]] if tensor else []]
    if kind == "scatter":  # (recorded: the piece this rank receives)
        return [[]], [tensor]
    if kind == "gather":  # (recorded: the piece this rank hands over)
        return [tensor], [[]]
    return [tensor], [tensor]


def _frame(where: str) -> dict:
    """A record's calling line ("FILE:LINE FUNC") as torch's frame."""
    place, _, name = where.partition(" ")
    filename, _, line = place.rpartition(":")
    return {"name": name, "filename": filename or place, "line": int(line) if line.isdigit() else 0}


def _entry(index: int, rec: dict, group_size: int) -> dict:
    kind = _TORCH_KIND.get(rec["kind"], rec["kind"])
    input_sizes, output_sizes = _sizes(kind, rec["shape"], group_size)
    dtypes = [rec["dtype"]] if rec.get("dtype") else []
    return {
        "record_id": index,
        "pg_id": 0,
        "process_group": (rec["group"], rec["dim"]),
        "collective_seq_id": rec["seq"],
        "p2p_seq_id": 0,
        "op_id": index + 1,
        "profiling_name": f"gloo:{kind}",
        "time_created_ns": None,
        "input_sizes": input_sizes,
        "input_dtypes": dtypes,
        "output_sizes": output_sizes,
        "output_dtypes": dtypes,
        "state": "scheduled",
        "time_discovered_started_ns": None,
        "time_discovered_completed_ns": None,
        "retired": False,
        "timeout_ms": None,
        "is_p2p": False,
        "frames": [_frame(rec["where"])],
        "where": rec["where"],
        "item": rec["item"],
        "dim": rec["dim"],
    }


def dumps(records: dict[int, list[dict]], topology: tuple[int, int, int]) -> dict[int, dict]:
    """Each participant's records of the case ({rank: records}, as flight.case_records reads them) as torch's
    flight recorder dump of that rank."""
    dims = {rec["group"]: rec["dim"] for recs in records.values() for rec in recs}
    out = {}
    for rank, groups in _groups(records, topology).items():
        kept = [rec for rec in records[rank] if rec["kind"] not in _P2P]
        entries = [_entry(i, rec, len(groups[rec["group"]])) for i, rec in enumerate(kept)]
        config = {group: {"name": group, "desc": dims[group], "ranks": str(ranks)} for group, ranks in groups.items()}
        out[rank] = {"version": VERSION, "pg_config": config, "pg_status": {}, "entries": entries}
    return out


def write(folder: Path, records: dict[int, list[dict]], topology: tuple[int, int, int]) -> Path:
    """The dumps in `folder`/FOLDER/PREFIX<rank>; returns that folder (what to hand the analyzer)."""
    out = folder / FOLDER
    out.mkdir(parents=True, exist_ok=True)
    for rank, dump in dumps(records, topology).items():
        (out / f"{PREFIX}{rank}").write_bytes(pickle.dumps(dump))
    return out
