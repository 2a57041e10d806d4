"""The driver side of the collective flight recorder: the ranks' records of a hung or dead case, compared.

Each rank wrote every collective it entered before entering it (harness/rank/flight_recorder.py).  For the case in
flight, the records on each process group are lined up rank by rank, by their number in the case: the first
position where the ranks disagree is the finding: "collective mismatch on tp: rank 0 in all_reduce #2 [4, 6]
float32 at a.py:57 f, rank 1 in all_gather #2 [8] int64 at a.py:60 g", or, where some ranks have no record,
"rank 1 never entered all_reduce #2 on tp (the others did); its last on tp: all_reduce #1 at ...".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from shardcheck.harness.driver.stacks import where_text
from shardcheck.harness.rank.flight_recorder import read_records

MESH_DIMS = ("dp", "cp", "tp")
# collectives whose tensors legitimately differ between ranks (splits, roots, point to point): compared by kind only
_SHAPE_FREE = {
    "all_to_all",
    "send",
    "recv",
    "gather",
    "scatter",
    "barrier",
    "all_gather_object",
    "broadcast_object_list",
}


@dataclass
class FlightFinding:
    text: str = ""  # "" when the records agree
    culprits: list[int] = field(default_factory=list)  # the ranks that left the others (never entered, the odd ones)
    where: str | None = None  # the first culprit's call, FILE:LINE


def read(launch_dir: Path, rank: int) -> list[dict]:
    """A rank's records (the last RING), in the order it entered them."""
    return read_records(launch_dir, rank)


def case_records(launch_dir: Path, ranks: list[int], plan: int, item: int) -> dict[int, list[dict]]:
    return {
        r: [rec for rec in read(launch_dir, r) if (rec.get("plan"), rec.get("item")) == (plan, item)] for r in ranks
    }


def members(dim: str, rank: int, topology: tuple[int, ...]) -> list[int]:
    """The ranks of `rank`'s group along `dim` ("tp", "dp|cp", "ep", "edp", "world") in a (dp, cp, tp) topology, or a
    (dp, cp, tp, ep) one (ep: the expert-parallel part of dp, innermost; edp the rest)."""
    dp, cp, tp = topology[:3]
    ep = topology[3] if len(topology) > 3 else 1
    size = dp * cp * tp
    along = set(dim.split("|")) if dim != "world" else set(MESH_DIMS)
    along |= {"ep", "edp"} if "dp" in along else set()
    if not along <= {*MESH_DIMS, "ep", "edp"}:
        return []

    def coords(r: int) -> dict[str, int]:
        d = r // (cp * tp)
        return {"edp": d // ep, "ep": d % ep, "cp": (r // tp) % cp, "tp": r % tp}

    mine = coords(rank)
    return [r for r in range(size) if all(coords(r)[d] == mine[d] for d in mine if d not in along)]


def _call(rec: dict) -> str:
    shape = f" {rec['shape']}" if rec.get("shape") is not None else ""
    dtype = f" {rec['dtype']}" if rec.get("dtype") else ""
    return f"{rec['kind']} #{rec['seq']}{shape}{dtype} at {where_text(rec['where'])}"


def _signature(rec: dict) -> tuple:
    if rec["kind"] in _SHAPE_FREE:
        return (rec["kind"],)
    return rec["kind"], tuple(rec["shape"] or ()), rec.get("dtype")


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def compare(records: dict[int, list[dict]], topology: tuple[int, int, int]) -> FlightFinding:
    """The first disagreement of the ranks' records on each process group (mismatched or never entered)."""
    by_group: dict[str, dict[int, list[dict]]] = {}
    dims: dict[str, str] = {}
    for rank, recs in records.items():
        for rec in recs:
            by_group.setdefault(rec["group"], {}).setdefault(rank, []).append(rec)
            dims[rec["group"]] = rec["dim"]
    texts, culprits, where = [], [], None
    for group, per_rank in by_group.items():
        dim = dims[group]
        ranks_along = members(dim, next(iter(per_rank)), topology) or sorted(per_rank)
        ranks_along = [r for r in ranks_along if r in records]  # ranks whose records were read
        longest = max(len(per_rank.get(r, [])) for r in ranks_along)
        for k in range(longest):
            at = {r: per_rank.get(r, [])[k] if k < len(per_rank.get(r, [])) else None for r in ranks_along}
            entered = {r: rec for r, rec in at.items() if rec is not None}
            missing = [r for r, rec in at.items() if rec is None]
            sigs: dict[tuple, list[int]] = {}
            for r, rec in entered.items():
                sigs.setdefault(_signature(rec), []).append(r)
            if len(sigs) > 1:
                groups = sorted(sigs.values(), key=lambda rs: (-len(rs), rs))
                texts.append(
                    f"collective mismatch on {dim}: "
                    + ", ".join(f"{_ranks(rs)} in {_call(entered[rs[0]])}" for rs in groups)
                )
                odd = [r for rs in (groups[1:] if len(groups[0]) > len(groups[1]) else groups) for r in rs]
                culprits += odd
                where = where or entered[odd[0]]["where"].split(" ")[0]
                break
            if missing:
                first = entered[min(entered)]
                last = [f"{_ranks([r])} last on {dim}: {_call(per_rank[r][-1])}" for r in missing if per_rank.get(r)]
                texts.append(
                    f"{_ranks(missing)} never entered {first['kind']} #{first['seq']} on {dim} "
                    f"(the others did, at {where_text(first['where'])})"
                    + (
                        f"; {'; '.join(last)}"
                        if last
                        else f"; {'it' if len(missing) == 1 else 'they'} entered no collective on {dim} in this case"
                    )
                )
                culprits += missing
                break
    return FlightFinding("; ".join(texts), sorted(set(culprits)), where)


def last_records(records: dict[int, list[dict]]) -> dict[int, dict]:
    """Each rank's last record in the case (what a waiting rank waits in)."""
    return {r: recs[-1] for r, recs in records.items() if recs}


def as_text(records: dict[int, list[dict]]) -> str:
    """The records for the failure artefacts, rank by rank."""
    out = []
    for rank, recs in sorted(records.items()):
        out.append(f"rank {rank}: {len(recs)} collective(s) in this case")
        out += [f"  {rec['dim']}: {_call(rec)}" for rec in recs]
    return "\n".join(out) + "\n"
