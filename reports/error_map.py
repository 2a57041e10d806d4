"""The error map of a failing check: |err| / budget over the full tensor, reduced to two dims,
with the topology's shard boundaries drawn and labelled by the ranks holding each piece.

The two dims shown are the sharded ones (those whose positions differ between ranks: DP batch
slices, CP chunks, TP vocab shards), then the last dims; the others are reduced by max, so a
single wrong element still shows.  A head-tail CP dim gives each rank two segments, both labelled
with its CP rank.  Under each segment label: the largest ratio inside it, so a wholly wrong
shard reads at a glance.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from shardcheck.harness.core.topology import MESH_DIMS, topology_label  # noqa: E402
from shardcheck.reports import png  # noqa: E402

DP_PARTS = ("ep", "edp", "dp_replicate", "dp_shard")  # dp's coordinates where a topology splits dp

MAX_CELLS = 240  # per displayed axis; longer axes are max-pooled into bins
RATIO_FLOOR = 1e-3  # ratios below show as the floor colour


def shown_dims(ndim: int, shards: dict[int, dict]) -> list[int]:
    """The (up to) two tensor dims to draw: sharded dims first, later dims before earlier ones."""

    def sharded(d: int) -> bool:
        return len({tuple(s["indices"][d].tolist()) for s in shards.values()}) > 1

    ranked = sorted(range(ndim), key=lambda d: (not sharded(d), -d))
    return sorted(ranked[:2])


def segments(dim: int, shards: dict[int, dict]) -> list[tuple[int, int, str]]:
    """[(start, end, label)] along tensor dim `dim`: each distinct piece's contiguous runs of global
    positions, labelled by the mesh coordinates that tell the pieces apart (e.g. 'tp1', 'cp0')."""
    groups: dict[tuple, list[int]] = {}
    for rank, s in sorted(shards.items()):
        groups.setdefault(tuple(s["indices"][dim].tolist()), []).append(rank)
    if len(groups) < 2:
        return []
    firsts = [shards[ranks[0]]["coords"] for ranks in groups.values()]
    varying = _telling_dims(firsts)
    out = []
    for positions, ranks in groups.items():
        coords = shards[ranks[0]]["coords"]
        label = ",".join(f"{m}{coords[m]}" for m in varying) or "r" + ",".join(map(str, ranks))
        pos = sorted(positions)
        if not pos:  # a rank holding none of this dim (an empty vocab shard at V < TP) marks no segment
            continue
        start = prev = pos[0]
        for p in pos[1:] + [None]:
            if p is None or p != prev + 1:
                out.append((start, prev + 1, label))
                if p is not None:
                    start = p
            if p is not None:
                prev = p
    return sorted(out)


def _telling_dims(firsts: list[dict]) -> list[str]:
    """The mesh dims whose coordinates tell the pieces apart: (dp, cp, tp), or dp's parts (ep, edp; HSDP's
    dp_replicate, dp_shard) in dp's place where they tell them apart in as few dims: experts over ep are 'ep0',
    'ep1'; tokens over the whole dp group stay 'dp0' .. 'dp3'."""
    varying = [m for m in (*MESH_DIMS, *DP_PARTS) if len({c.get(m) for c in firsts}) > 1]
    by_dp = [m for m in varying if m not in DP_PARTS]
    by_parts = [m for m in varying if m != "dp"]
    tells = len({tuple(c.get(m) for m in by_parts) for c in firsts}) == len(firsts)
    return by_parts if by_parts != by_dp and tells and len(by_parts) <= len(by_dp) else by_dp


def _reduce(ratio: np.ndarray, dims: list[int]) -> np.ndarray:
    """Max over the dims not shown (NaN = no rank holds it), as a 2-D array (rows, cols)."""
    other = tuple(d for d in range(ratio.ndim) if d not in dims)
    with np.errstate(all="ignore"):
        masked = np.where(np.isnan(ratio), -np.inf, ratio)
        reduced = masked.max(axis=other) if other else masked
    reduced = np.where(reduced == -np.inf, np.nan, reduced)
    return reduced.reshape(1, -1) if reduced.ndim < 2 else reduced


def _pool(grid: np.ndarray, axis: int) -> tuple[np.ndarray, int]:
    """Max-pool `axis` down to at most MAX_CELLS bins; returns (grid, bin width)."""
    n = grid.shape[axis]
    if n <= MAX_CELLS:
        return grid, 1
    width = -(-n // MAX_CELLS)
    pad = width * -(-n // width) - n
    padded = (
        np.concatenate([grid, np.full(grid.shape[:axis] + (pad,) + grid.shape[axis + 1 :], np.nan)], axis=axis)
        if pad
        else grid
    )
    shape = list(padded.shape)
    shape[axis : axis + 1] = [shape[axis] // width, width]
    with np.errstate(all="ignore"):
        pooled = np.nanmax(np.where(np.isnan(padded), -np.inf, padded).reshape(shape), axis=axis + 1)
    return np.where(pooled == -np.inf, np.nan, pooled), width


def draw_error_map(
    abs_err: torch.Tensor,
    budget: float | torch.Tensor,
    shards: dict[int, dict],
    title: str,
    path: Path,
    worst: list[int] | None = None,
) -> Path:
    """Draw |err| / budget of a full tensor with its shard boundaries; writes `path` (PNG).  `budget`:
    one number, or the per-element budgets (same shape; NaN where no rank holds a position)."""
    err = abs_err.double().numpy()
    limit = torch.as_tensor(budget, dtype=torch.float64).expand(abs_err.shape).numpy()
    with np.errstate(all="ignore"):
        ratio = np.where(limit > 0, err / limit, np.where(err > 0, np.inf, 0.0))
    ratio = np.where(np.isnan(err) | np.isnan(limit), np.nan, ratio)
    held = limit[~np.isnan(limit)]
    budget_text = (
        f"budget {held.max():.3g}"
        if held.size and held.min() == held.max()
        else f"per-row budgets {held.min():.3g}..{held.max():.3g}"
        if held.size
        else "no budget"
    )
    dims = shown_dims(err.ndim, shards)
    grid = _reduce(ratio, dims)
    row_dim, col_dim = (dims + [None, None])[:2] if len(dims) == 2 else (None, dims[0] if dims else None)
    grid, row_bin = _pool(grid, 0)
    grid, col_bin = _pool(grid, 1)

    finite_max = np.nanmax(np.where(np.isinf(grid), np.nan, grid)) if np.isfinite(grid).any() else 1.0
    top = max(10.0, float(finite_max) if np.isfinite(finite_max) else 10.0)
    shown = np.log10(np.clip(np.where(np.isinf(grid), top, grid), RATIO_FLOOR, top))
    cmap = matplotlib.colormaps["RdYlGn_r"].with_extremes(bad="#bbbbbb")  # grey: positions no rank holds
    norm = matplotlib.colors.TwoSlopeNorm(vmin=np.log10(RATIO_FLOOR), vcenter=0.0, vmax=np.log10(top))

    rows, cols = grid.shape
    height = 2.6 if rows == 1 else min(7.0, max(3.4, 7.0 * rows / max(cols, 1) + 1.6))
    # Fixed margins in inches (a layout engine costs as much as the drawing, and a failing run draws many):
    # the title and the column shards' labels above, the row shards' labels and the colour bar to the right.
    width = 10.0
    fig = plt.figure(figsize=(width, height))
    ax = fig.add_axes((0.8 / width, 0.55 / height, 1 - 3.1 / width, 1 - 1.55 / height))
    cax = fig.add_axes((1 - 1.1 / width, 0.55 / height, 0.15 / width, 1 - 1.55 / height))
    im = ax.imshow(shown, cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
    cbar = fig.colorbar(im, cax=cax)
    cbar.set_label("log10(|err| / budget)   (> 0 fails)", fontsize=8)
    cbar.ax.tick_params(labelsize=7)

    def axis_label(d: int | None) -> str:
        if d is None:
            return ""
        splitters = _splitting_mesh_dims(d, shards)
        pooled = row_bin if d == row_dim else col_bin
        return (
            f"dim {d} ({err.shape[d]} positions"
            + (f", {pooled} per cell" if pooled > 1 else "")
            + ")"
            + (f" — split over {'/'.join(splitters)}" if splitters else "")
        )

    ax.set_xlabel(axis_label(col_dim), fontsize=9)
    ax.set_ylabel(axis_label(row_dim), fontsize=9)
    ax.tick_params(labelsize=7)
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    if rows == 1:
        ax.set_yticks([])
    for start, end, label, value in _segment_stats(col_dim, shards, ratio, dims):
        x0, x1 = start / col_bin - 0.5, end / col_bin - 0.5
        ax.axvline(x0, color="black", lw=1.2)
        ax.axvline(x1, color="black", lw=1.2)
        ax.text(
            (x0 + x1) / 2,
            1.01,
            f"{label}\nmax {value:.2g}",
            transform=ax.get_xaxis_transform(),
            ha="center",
            va="bottom",
            fontsize=7,
            fontweight="bold",
            clip_on=False,
        )
    for start, end, label, value in _segment_stats(row_dim, shards, ratio, dims):
        y0, y1 = start / row_bin - 0.5, end / row_bin - 0.5
        ax.axhline(y0, color="black", lw=1.2, ls="--")
        ax.axhline(y1, color="black", lw=1.2, ls="--")
        ax.text(
            1.005,
            (y0 + y1) / 2,
            f"{label} max {value:.2g}",
            transform=ax.get_yaxis_transform(),
            ha="left",
            va="center",
            fontsize=7,
            fontweight="bold",
            clip_on=False,
        )
    if worst is not None and len(worst) == err.ndim and dims:
        r = worst[row_dim] / row_bin if row_dim is not None else 0
        c = worst[col_dim] / col_bin if col_dim is not None else 0
        ax.plot([c], [r], marker="o", ms=11, mfc="none", mec="blue", mew=2)
    failing = np.sum(ratio > 1)
    reduced = [d for d in range(err.ndim) if d not in dims]
    ax.set_title(
        f"{title}\n|err| / budget ({budget_text})"
        + (f", max over dim {', '.join(map(str, reduced))}" if reduced else "")
        + f"; {failing} of {ratio.size} elements fail"
        + ("; o = worst element" if worst else "")
        + ("" if any(segments(d, shards) for d in range(err.ndim)) else "; not split: every rank holds all of it"),
        fontsize=9,
        pad=28 if col_dim is not None and _segment_stats(col_dim, shards, ratio, dims) else 6,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    png.save(fig, path, dpi=100)
    return path


def _splitting_mesh_dims(dim: int, shards: dict[int, dict]) -> list[str]:
    segs = segments(dim, shards)
    return sorted({"".join(ch for ch in part if ch.isalpha()) for _, _, label in segs for part in label.split(",")})


def _segment_stats(dim: int | None, shards: dict[int, dict], ratio: np.ndarray, dims: list[int]):
    """segments() of `dim` with the largest ratio inside each."""
    if dim is None:
        return []
    out = []
    for start, end, label in segments(dim, shards):
        part = np.take(ratio, np.arange(start, end), axis=dim)
        value = float(np.nanmax(part)) if np.isfinite(part).any() or np.isinf(part).any() else float("nan")
        out.append((start, end, label, value))
    return out


def draw_artefact(artefact: Path, path: Path, worst: list[int] | None = None) -> Path:
    """The error map of a saved failure artefact (`failures/<item>/<check>.pt`, harness/rank/artefacts.py), to
    `path`."""
    full = torch.load(artefact, weights_only=False)
    return draw_error_map(full["abs_err"], full["budget"], full["shards"], artefact_title(full), path, worst=worst)


def artefact_title(full: dict) -> str:
    """An error map's title: op, case, topology as Topology names it ("dp4-ep2-cp1-tp1"; an artefact saved before
    ep and dp_replicate: 1), dtype, check."""
    topology = topology_label(full["topology"])
    return f"{full['op']} [{full['case_id']}] {topology} {full['dtype']} {full['check']}"
