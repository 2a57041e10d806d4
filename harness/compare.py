"""Budgets, per-rank comparison against the golden, and merging ranks into one result row.

float64: the sharded op must match the float64 golden to RTOL_FLOAT64 of the tensor's
largest magnitude: any indexing, offset, reduction or layout bug lands far above that.

Low precision: budget = KAPPA * err_naive + FLOOR_ULPS * eps(out dtype) * scale, where
err_naive is the max error of the *reference* run in the same dtype on one device (inputs
rounded the same way) and scale the golden's largest finite magnitude.  The floor matters
where err_naive is small by luck (a scalar loss: one rounding).  Calibrated with
`python -m harness.calibrate` (see README): over 4 seeds x 11,696 low-precision checks of
correct implementations, err/budget reached 0.26 at most (99th percentile 0.16); with the
first guess (KAPPA 4, one ulp) it reached 0.94, too close to flaking.
"""

from __future__ import annotations

import math

import torch

RTOL_FLOAT64 = 1e-10
KAPPA = 8.0
FLOOR_ULPS = 4.0
STATUS_ORDER = {"pass": 0, "skip": 1, "fail": 2, "error": 3}


def _finite_max_abs(t: torch.Tensor) -> float:
    t = t[torch.isfinite(t)]
    return float(t.abs().max()) if t.numel() else 0.0


def budget(golden: torch.Tensor, naive: torch.Tensor | None, out_dtype: torch.dtype) -> tuple[float, float | None]:
    """(largest acceptable max-abs error, err_naive) for a tensor whose golden is `golden` (float64)."""
    scale = _finite_max_abs(golden)
    if out_dtype == torch.float64 or naive is None:
        return RTOL_FLOAT64 * max(scale, 1e-30), None
    both = torch.isfinite(golden) & torch.isfinite(naive.double())
    err_naive = float((naive.double() - golden)[both].abs().max()) if both.any() else 0.0
    return KAPPA * err_naive + FLOOR_ULPS * torch.finfo(out_dtype).eps * max(scale, 1e-30), err_naive


def compare(got: torch.Tensor, expected: torch.Tensor) -> dict:
    """Errors of one rank's local tensor against the matching slice of the golden.

    Returns max_abs_err, max_rel_err, the worst element (local index, expected, got)
    and the first position where non-finite values differ (NaN/±Inf must match exactly).
    """
    if tuple(got.shape) != tuple(expected.shape):
        return {"shape_mismatch": [list(got.shape), list(expected.shape)]}
    g = got.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    fin_g, fin_e = torch.isfinite(g), torch.isfinite(e)
    same_nonfinite = ~fin_g & ~fin_e & ((g == e) | (torch.isnan(g) & torch.isnan(e)))
    bad_nonfinite = (~fin_g | ~fin_e) & ~same_nonfinite
    both = fin_g & fin_e
    diff = torch.where(both, (g - e).abs(), torch.zeros_like(g))
    out: dict = {"max_abs_err": 0.0, "max_rel_err": 0.0, "worst": None, "nonfinite": None}
    if diff.numel():
        flat = int(diff.argmax())
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
        out["max_abs_err"] = float(diff.reshape(-1)[flat])
        nonzero = both & (e != 0)  # relative error is undefined where the golden is exactly 0
        rel = torch.where(nonzero, diff / e.abs().where(nonzero, torch.ones_like(e)), torch.zeros_like(e))
        out["max_rel_err"] = float(rel.max())
        out["worst"] = {"local_index": list(idx), "expected": float(e[idx]), "got": float(g[idx])}
    n_bad = int(bad_nonfinite.sum())
    if n_bad:
        idx = tuple(int(i) for i in bad_nonfinite.nonzero()[0])
        out["nonfinite"] = {"count": n_bad, "local_index": list(idx), "expected": _num(e[idx]), "got": _num(g[idx])}
    return out


def _num(x: torch.Tensor) -> float | str:
    v = float(x)
    return v if math.isfinite(v) else str(v)  # JSON has no inf/nan


def judge(stats: dict, budget_value: float) -> tuple[str, float]:
    """(status, err_ratio) of one rank's stats against its budget."""
    if "shape_mismatch" in stats or stats.get("nonfinite"):
        return "fail", math.inf
    ratio = stats["max_abs_err"] / budget_value if budget_value > 0 else (0.0 if stats["max_abs_err"] == 0 else math.inf)
    return ("pass" if ratio <= 1.0 else "fail"), ratio


def describe(rank_result: dict) -> str:
    """One line saying where one rank went wrong."""
    where = f"rank {rank_result['rank']} ({_coords(rank_result['coords'])})"
    if rank_result.get("message") and rank_result["status"] == "error":
        then = " (after a peer failed)" if rank_result.get("secondary") else ""
        return f"{where}{then}: {rank_result['message']}"
    if "shape_mismatch" in rank_result:
        got, exp = rank_result["shape_mismatch"]
        return f"{where}: local shape {tuple(got)}, expected {tuple(exp)}"
    nf = rank_result.get("nonfinite")
    if nf:
        return (f"{where}: {nf['count']} non-finite mismatch(es), first at global {tuple(nf['global_index'])} "
                f"(local {tuple(nf['local_index'])}): expected {nf['expected']}, got {nf['got']}")
    w = rank_result.get("worst")
    if w:
        return (f"{where}: |err| {rank_result['max_abs_err']:.3g} > budget {rank_result['budget']:.3g} at global "
                f"{tuple(w['global_index'])} (local {tuple(w['local_index'])}): expected {w['expected']:.10g}, got {w['got']:.10g}")
    return f"{where}: {rank_result.get('message', 'failed')}"


def _coords(coords: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in coords.items())


def merge_ranks(per_rank: list[dict], expected_ranks: list[int]) -> dict:
    """Fold every rank's result for one check into the row's status, errors and mismatch."""
    seen = {r["rank"] for r in per_rank}
    missing = [r for r in expected_ranks if r not in seen]
    status = max((r["status"] for r in per_rank), key=STATUS_ORDER.__getitem__, default="error")
    if missing:
        status = "error"
    def worst(key: str):
        return max((r[key] for r in per_rank if r.get(key) is not None), default=None)

    row = {
        "status": status,
        **{key: worst(key) for key in ("max_abs_err", "max_rel_err", "budget", "err_ratio", "err_naive")},
        "mismatch": None,
        "message": "",
        **merge_measurements(per_rank),
        "per_rank": [
            {k: r.get(k) for k in ("rank", "coords", "status", "max_abs_err", "err_ratio")} for r in sorted(per_rank, key=lambda r: r["rank"])
        ],
    }
    # The likely cause first: errors a peer's failure caused ("connection closed by peer") come last.
    bad = sorted((r for r in per_rank if r["status"] in ("fail", "error")),
                 key=lambda r: (bool(r.get("secondary")), -STATUS_ORDER[r["status"]], -(r.get("err_ratio") or 0), r["rank"]))
    parts = [describe(r) for r in bad[:1]]
    if bad:
        worst = bad[0]
        loc = worst.get("nonfinite") or worst.get("worst") or {}
        row["mismatch"] = {
            "rank": worst["rank"],
            "coords": worst["coords"],
            "global_index": loc.get("global_index"),
            "local_index": loc.get("local_index"),
            "expected": loc.get("expected"),
            "got": loc.get("got"),
            "kind": "error" if worst["status"] == "error" else ("nonfinite" if worst.get("nonfinite") else
                                                               "shape" if "shape_mismatch" in worst else "value"),
        }
        others = sorted({r["rank"] for r in bad})
        parts.append(f"failing rank(s): {', '.join(map(str, others))}")
    if missing:
        parts.append(f"no result from rank(s) {', '.join(map(str, missing))}")
    if status == "skip" and not parts:  # the reason the ranks gave (the same on every rank)
        parts = [next((r["message"] for r in per_rank if r.get("message")), "")]
    row["message"] = "; ".join(parts)
    return row


MEASURED_MAX = ("time_ms", "time_ms_iqr", "time_fwd_ms", "time_bwd_ms", "peak_bytes", "peak_bytes_fwd",
                "ref_time_ms", "ref_time_ms_iqr", "ref_peak_bytes")


def merge_measurements(per_rank: list[dict]) -> dict:
    """Measured fields: the max over ranks (times are already per-iteration maxima; memory is
    the worst rank's); collectives the elementwise max over ranks."""
    out = {}
    for key in MEASURED_MAX:
        values = [r[key] for r in per_rank if r.get(key) is not None]
        if values:
            out[key] = max(values)
    for key in ("comm_calls", "comm_bytes"):
        merged: dict = {}
        for r in per_rank:
            for phase, kinds in (r.get(key) or {}).items():
                for kind, n in kinds.items():
                    merged.setdefault(phase, {})[kind] = max(n, merged.get(phase, {}).get(kind, 0))
        if any(r.get(key) is not None for r in per_rank):
            out[key] = merged
    for key in ("times_ms", "ref_times_ms", "iters", "warmup", "comm_allowed"):  # identical on every rank
        values = [r[key] for r in per_rank if r.get(key) is not None]
        if values:
            out[key] = values[0]
    return out
