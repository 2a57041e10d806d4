"""Failure artefacts: the full expected and actual tensors of a failing check, reassembled from
every rank's piece, from which the report draws its error map.

Workers save their pieces (local got, local expected, and the global positions the piece holds
per tensor dim, from `Layout.indices`) for items that failed somewhere, while the plan's
`failure_artefacts` budget lasts; the driver reassembles them here into
`failures/<item>/<check>.pt`; the report draws `failures/<item>/<check>.png` from it (reports/error_map.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from shardcheck.harness.core.plan_data import Item

MAX_FAILURE_ITEMS = 8  # items per run whose failing tensors are kept
MAX_NUMEL = 4 * 2**20  # per full tensor: 32 MiB in float64; larger ones are not saved


def item_dir_name(item: Item) -> str:
    """failures/<this>/: readable and unique within a run (the item id leads)."""
    text = f"{item.id:05d}-{item.op}-{item.case_id}-{item.full_topology}-{item.dtype}"  # dp4-ep2-cp1-tp1 at ep 2
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", text)


def check_file_stem(check: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", check)


def abs_error(got: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """|got - expected| elementwise in float64; a non-finite mismatch is inf, matching non-finites 0."""
    g, e = got.double(), expected.double()
    both = torch.isfinite(g) & torch.isfinite(e)
    same = (g == e) | (torch.isnan(g) & torch.isnan(e))
    return torch.where(both, (g - e).abs(), torch.where(same, 0.0, torch.inf))


def reassemble(pieces: dict[int, dict]) -> dict:
    """Full expected/actual tensors from per-rank pieces ({rank: piece}); where ranks overlap (replicated
    dims) the actual value kept is the one furthest from the expected, so a wrong replica shows.
    Positions no rank holds stay NaN."""
    first = pieces[min(pieces)]
    shape = tuple(first["full_shape"])
    expected = torch.full(shape, torch.nan, dtype=torch.float64)
    actual = torch.full(shape, torch.nan, dtype=torch.float64)
    err = torch.full(shape, -1.0, dtype=torch.float64)
    limit = torch.full(
        shape, torch.nan, dtype=torch.float64
    )  # per-element budgets (shardcheck.harness.core.compare.budget)
    for rank in sorted(pieces):
        p = pieces[rank]
        grid = torch.meshgrid(*[ix.long() for ix in p["indices"]], indexing="ij") if shape else ()
        got, exp = p["got"].double(), p["expected"].double()
        e = abs_error(got, exp)
        worse = e >= err[grid]
        actual[grid] = torch.where(worse, got, actual[grid])
        expected[grid] = exp
        err[grid] = torch.maximum(e, err[grid])
        limit[grid] = torch.as_tensor(p["budget"], dtype=torch.float64).expand(exp.shape)
    err = torch.where(err < 0, torch.nan, err)
    return {
        "expected": expected,
        "actual": actual,
        "abs_err": err,
        "budget": limit,
        "actual_dtype": str(first["got"].dtype).removeprefix("torch."),
        "shards": {
            r: {"coords": pieces[r]["coords"], "indices": [ix.long() for ix in pieces[r]["indices"]]}
            for r in sorted(pieces)
        },
    }


class ArtefactBudget:
    """How many failing items of a run still get artefacts (shared by every launch of the run)."""

    def __init__(self, max_items: int = MAX_FAILURE_ITEMS):
        self.max_items = max_items
        self.saved = 0

    @property
    def left(self) -> int:
        return max(self.max_items - self.saved, 0)

    def save(self, item: Item, failing: list[str], pieces_dir: Path, run_dir: Path) -> dict[str, dict]:
        """Write failures/<item>/<check>.pt for each failing check with pieces; returns {check: {"artefact":
        relative path, "error_map": relative path of the PNG the report draws from it}}."""
        if not self.left:
            return {}
        by_rank = {}
        for path in sorted(pieces_dir.glob("rank*.pt")):
            try:
                by_rank[int(path.stem[4:])] = torch.load(path, weights_only=False)
            except Exception:  # a rank killed while writing: use the others
                continue
        out_dir = run_dir / "failures" / item_dir_name(item)
        saved = {}
        for check in failing:
            pieces = {r: d[check] for r, d in by_rank.items() if check in d}
            if not pieces:
                continue
            full = reassemble(pieces)
            dp, cp, tp = item.topology
            topology = {"dp": dp, "cp": cp, "tp": tp, "ep": item.ep, "dp_replicate": item.dp_replicate}
            full.update(
                {
                    "op": item.op,
                    "case_id": item.case_id,
                    "topology": topology,
                    "dtype": item.dtype,
                    "check": check,
                    "seed": item.seed,
                }
            )
            out_dir.mkdir(parents=True, exist_ok=True)
            stem = check_file_stem(check)
            torch.save(full, out_dir / f"{stem}.pt")
            # the picture is the report's (reports/error_map.py draws it from the .pt when it builds the pages)
            saved[check] = {
                "artefact": str(Path("failures", out_dir.name, f"{stem}.pt")),
                "error_map": str(Path("failures", out_dir.name, f"{stem}.png")),
            }
        if saved:
            self.saved += 1
        return saved
