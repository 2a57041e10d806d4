"""Budgets, per-rank comparison against the golden, and merging ranks into one result row.

float64: the sharded op must match the float64 golden to RTOL_FLOAT64 of the tensor's
largest magnitude: any indexing, offset, reduction or layout bug lands far above that.

Low precision: budgets are per row (the last dim: one token's logits, one vocab row of a weight
gradient; a scalar's row is itself): budget = KAPPA * err_naive_row + FLOOR_ULPS * eps(out dtype)
* scale_row, where err_naive_row is the max error in that row of the *reference* run in the same
dtype on one device (inputs rounded the same way) and scale_row the golden row's largest finite
magnitude.  A row whose golden and reference are both exactly 0 (the gradient at a masked target)
gets budget 0: correct code gives exact zeros there.  A tensor-wide scale let huge rows hide errors
in rows of zeros (x100 bfloat16 logits: a gradient error of ~1 at masked targets passed).  The
floor matters where err_naive is small by luck (a scalar loss: one rounding).  Where each rank's
output is its own summand of the loss (summed_over), the reference backpropagates each summand and
adds the gradients in its dtype, as the ranks do.  Calibrated with `python -m shardcheck.harness.calibrate
--seeds 4` (the full default matrix, every suite; 4 x 4,963 float32/bfloat16 values and gradients of
correct code; README, Calibration): with KAPPA 20 and 8 ulps for both dtypes float32 reached 0.85
(err/err_naive 30, on 37-wide rows of from_parallel_logits_to_logprobs' gradient, at tp = cp = 1 as
much as sharded: the reference computing a row more exactly by luck), bfloat16 0.28; hence float32's
own constants, with which float32 reaches 0.42 (99th percentile 0.14) and bfloat16 0.28.
Per-row budgets with the tensor-wide constants (KAPPA 8, 4 ulps) flagged a real bfloat16
accumulation in gather_logits_at_global_indices (since fixed); without the per-summand reference,
CP gradients in float32 reached 13.7.

Scale floor (every dtype): no budget falls below SCALE_FLOOR_ULPS ulps of the math's dtype (float64; float32 for
float32 and bfloat16) at the largest golden magnitude among the item's tensors of the same kind (Golden.output_scale,
Golden.grad_scale), except rows of exact zeros in golden and reference: a GPT-2 key bias gradient, exactly 0 in exact
arithmetic, held ~1e-16 of round-off in float64 and got a budget of 1e-26, so the correct plan was warned "float64
computed in float32".  A tensor whose golden is exact zeros throughout (its kind's scale may be 0 too) is a
cancellation of terms at the scale of the inputs that made it (Golden.input_scale: a gradient's upstream gradients, an
output's inputs): its floor is SCALE_FLOOR_ULPS ulps of that scale (a one-entry vocab's log-softmax gradient, g - g·1,
left 1.2e-7 of float32 round-off against a budget of 0), while rows of zeros beside nonzero ones (a masked target's
gradient) keep budget 0, and a wrong zero of any size the inputs' scale makes still fails.

Statuses: pass < skip < xfail < warn < xpass < fail < error.  `warn` is a finding that is not a sharding
bug: a float64 result within the float32 budget (float64 computed in float32), a bfloat16 result within
the budget of bfloat16 math, collectives beyond the communication contract.  It fails a run only
under `--strict`.  `xfail` and `xpass` are set by the driver on the checks a case's KnownFailure covers
(shardcheck.harness.driver.collect): a known failure that still fails (never fails a run), and one that now passes on
every rank (fails a run: the mark must go).  Ranks report pass, skip, warn, fail and error only.
"""

from __future__ import annotations

import enum
import math

import torch

from shardcheck.harness.core.grad_convention import ranks_agree
from shardcheck.harness.core.records import Status, Symptom

RTOL_FLOAT64 = 1e-10
# Per output dtype (shardcheck.harness.calibrate on the full default matrix): float32 rows are short (a 37-token
# vocab) and their err_naive is small by luck more often than bfloat16's, which input rounding dominates.
KAPPA = {torch.float32: 30.0, torch.bfloat16: 20.0, torch.float16: 20.0}
FLOOR_ULPS = {torch.float32: 24.0, torch.bfloat16: 8.0, torch.float16: 8.0}
# No budget falls below SCALE_FLOOR_ULPS ulps of the math's dtype (float64 for float64 items, float32 otherwise: the
# ops compute low precision in float32) at the scale of the item's tensors of the same kind: a value that cancels to
# ~0 (the gradient of a key bias) carries the round-off of terms at that scale, not at its own.
SCALE_FLOOR_ULPS = 24.0
STATUS_ORDER = {status: status.order for status in Status}
NOT_PASSING = (Status.WARN, Status.XPASS, Status.FAIL, Status.ERROR)  # findings (an xfail is known, not a finding)
FAILING = (Status.XPASS, Status.FAIL, Status.ERROR)  # statuses that fail a run whatever --strict says
PRECISION_WARNINGS = ("float64 computed in float32", "bfloat16 math")  # how the worker words them


def _finite_max_abs(t: torch.Tensor) -> float:
    t = t[torch.isfinite(t)]
    return float(t.abs().max()) if t.numel() else 0.0


class BudgetScope(enum.StrEnum):
    """What one low-precision budget covers: a row (the last dim: an op's token, vocab row), or the whole tensor (a
    model's activations, whose rows can be exact zeros on one device and rounding noise when sharded: the gradient of
    the first query under a causal mask)."""

    ROW = "row"
    TENSOR = "tensor"


def finite_max_abs(t: torch.Tensor | None) -> float:
    """The largest finite magnitude of a float tensor (0 for anything else): a kind's scale is the max over its
    tensors (budget's `kind_scale`)."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        return 0.0
    return _finite_max_abs(t.detach())


def scale_floor(out_dtype: torch.dtype, scale: float) -> float:
    """The least budget of a tensor whose kind's scale (the item's largest golden magnitude among tensors of its kind)
    is `scale`: SCALE_FLOOR_ULPS ulps of the math's dtype there."""
    math_dtype = torch.float64 if out_dtype == torch.float64 else torch.float32
    return SCALE_FLOOR_ULPS * torch.finfo(math_dtype).eps * scale


def budget(
    golden: torch.Tensor,
    naive: torch.Tensor | None,
    out_dtype: torch.dtype,
    scope: BudgetScope = BudgetScope.ROW,
    kind_scale: float = 0.0,
    input_scale: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-element budgets for a tensor whose golden is `golden` (float64): (largest acceptable |err|
    at each element, the reference's error in that element's row (or tensor, `scope`) or None), both float64 in the
    golden's shape (expanded views: slice them with the output's Layout like the golden).  `kind_scale`: the largest
    golden magnitude among the item's tensors of the same kind; no budget falls below scale_floor of it, but a row
    whose golden and reference are both exact zeros keeps budget 0.  `input_scale`: the largest magnitude among the
    inputs that made the tensor; a golden of exact zeros throughout gets no budget below scale_floor of it."""
    g = golden.detach().double()
    if not out_dtype.is_floating_point or g.numel() == 0:  # ids, masks, layouts: exact
        return torch.zeros_like(g), None
    all_zeros = input_scale > 0 and not bool(g.any())  # exact zeros throughout: a cancellation at the inputs' scale
    floor = scale_floor(out_dtype, max(kind_scale, input_scale) if all_zeros else kind_scale)
    if out_dtype == torch.float64 or naive is None:
        return torch.full_like(g, max(RTOL_FLOAT64 * max(_finite_max_abs(g), 1e-30), floor)), None
    if scope == BudgetScope.TENSOR:
        rows = g.reshape(1, -1)
    else:
        rows = g.reshape(-1, g.shape[-1]) if g.ndim else g.reshape(1, 1)
    n = naive.detach().double().reshape(rows.shape)
    scale = torch.where(torch.isfinite(rows), rows.abs(), 0.0).amax(-1, keepdim=True)
    both = torch.isfinite(rows) & torch.isfinite(n)
    err_naive = torch.where(both, (n - rows).abs(), 0.0).amax(-1, keepdim=True)
    limit = KAPPA[out_dtype] * err_naive + FLOOR_ULPS[out_dtype] * torch.finfo(out_dtype).eps * scale
    exact_zeros = (scale == 0) & (err_naive == 0)  # a masked target's gradient: correct code gives exact zeros
    limit = limit.clamp_min(floor) if all_zeros else torch.where(exact_zeros, 0.0, limit.clamp_min(floor))
    return limit.expand(rows.shape).reshape(g.shape), err_naive.expand(rows.shape).reshape(g.shape)


def compare(
    got: torch.Tensor, expected: torch.Tensor, limit: torch.Tensor | None = None, err_naive: torch.Tensor | None = None
) -> dict:
    """Errors of one rank's local tensor against the matching slice of the golden.

    Returns max_abs_err, max_rel_err, the worst element (local index, expected, got) and the first
    position where non-finite values differ (NaN/±Inf must match exactly).  With `limit` (this
    rank's slice of the per-element budgets, and of err_naive), also err_ratio = max |err|/budget;
    the worst element is then the one with the largest ratio, and `budget`/`err_naive` are its row's.
    """
    if tuple(got.shape) != tuple(expected.shape):
        return {"shape_mismatch": [list(got.shape), list(expected.shape)]}
    g = got.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    both = torch.isfinite(g) & torch.isfinite(e)
    # Most tensors are finite throughout: their non-finite bookkeeping (a dozen small tensor ops) is skipped.
    all_finite = bool(both.all())
    diff = (g - e).abs() if all_finite else torch.where(both, (g - e).abs(), torch.zeros_like(g))
    out: dict = {"max_abs_err": 0.0, "max_rel_err": 0.0, "worst": None, "nonfinite": None}
    if diff.numel():
        flat = int(diff.argmax())
        idx = _unravel(flat, diff.shape)
        out["max_abs_err"] = float(diff.reshape(-1)[flat])
        nonzero = (e != 0) if all_finite else both & (e != 0)  # relative error is undefined where the golden is 0
        rel = torch.where(nonzero, diff / e.abs().where(nonzero, torch.ones_like(e)), torch.zeros_like(e))
        out["max_rel_err"] = float(rel.max())
        out["worst"] = {"local_index": list(idx), "expected": float(e[idx]), "got": float(g[idx])}
        if limit is not None:
            b = limit.detach().to("cpu", torch.float64)
            ratio = torch.where(diff == 0, 0.0, diff / b)  # an error where the budget is 0: inf
            flat = int(ratio.argmax()) if float(ratio.max()) > 0 else flat
            idx = _unravel(flat, diff.shape)
            out["err_ratio"] = float(ratio.reshape(-1)[flat])
            out["budget"] = float(b[idx])
            out["err_naive"] = float(err_naive.reshape(-1)[flat]) if err_naive is not None else None
            out["worst"] = {"local_index": list(idx), "expected": float(e[idx]), "got": float(g[idx])}
    if not all_finite:
        _nonfinite(g, e, out)
    return out


def _nonfinite(g: torch.Tensor, e: torch.Tensor, out: dict) -> None:
    """out["nonfinite"]: the count and first position of non-finite values that differ (NaN matches NaN, an infinity
    only itself), where any do."""
    fin_g, fin_e = torch.isfinite(g), torch.isfinite(e)
    same_nonfinite = ~fin_g & ~fin_e & ((g == e) | (torch.isnan(g) & torch.isnan(e)))
    bad_nonfinite = (~fin_g | ~fin_e) & ~same_nonfinite
    n_bad = int(bad_nonfinite.sum())
    if n_bad:
        idx = tuple(int(i) for i in bad_nonfinite.nonzero()[0])
        out["nonfinite"] = {"count": n_bad, "local_index": list(idx), "expected": _num(e[idx]), "got": _num(g[idx])}


def _unravel(flat: int, shape: torch.Size) -> tuple[int, ...]:
    """The index of element `flat` of a contiguous tensor of `shape` (torch.unravel_index's answer, without its
    tensor ops: it ran twice for every tensor judged, ~0.1 ms each)."""
    idx = []
    for size in reversed(shape):
        flat, i = divmod(flat, size)
        idx.append(i)
    return tuple(reversed(idx))


def _num(x: torch.Tensor) -> float | str:
    v = float(x)
    return v if math.isfinite(v) else str(v)  # JSON has no inf/nan


def judge(stats: dict, budget_value: float | None = None) -> tuple[str, float]:
    """(status, err_ratio) of one rank's stats against its budget (the per-element ratio `compare`
    computed when it was given budgets, else max_abs_err / budget_value)."""
    if "shape_mismatch" in stats or stats.get("nonfinite"):
        return Status.FAIL, math.inf
    if "err_ratio" in stats:
        ratio = stats["err_ratio"]
    elif not budget_value:  # no budget (an empty tensor, or exact values): any error fails
        ratio = 0.0 if stats["max_abs_err"] == 0 else math.inf
    else:
        ratio = (
            stats["max_abs_err"] / budget_value
            if budget_value > 0
            else (0.0 if stats["max_abs_err"] == 0 else math.inf)
        )
    return (Status.PASS if ratio <= 1.0 else Status.FAIL), ratio


def describe(rank_result: dict) -> str:
    """One line saying where one rank went wrong, with every reason it failed (a wrong dtype, shape,
    non-finite values, an error over budget): a row never hides its cause behind another."""
    where = f"rank {rank_result['rank']} ({_coords(rank_result['coords'])})"
    if rank_result.get("message") and rank_result["status"] == Status.ERROR:
        then = " (after a peer failed)" if rank_result.get("secondary") else ""
        return f"{where}{then}: {rank_result['message']}"
    reasons = [rank_result["message"]] if rank_result.get("message") else []
    if "shape_mismatch" in rank_result:
        got, exp = rank_result["shape_mismatch"]
        reasons.append(f"local shape {tuple(got)}, expected {tuple(exp)}")
    nf = rank_result.get("nonfinite")
    if nf:
        reasons.append(
            f"{nf['count']} non-finite mismatch(es), first at global {tuple(nf['global_index'])} "
            f"(local {tuple(nf['local_index'])}): expected {nf['expected']}, got {nf['got']}"
        )
    w = rank_result.get("worst")
    limit = rank_result.get("budget")
    err = abs(w["got"] - w["expected"]) if w else None  # the worst element's (per-row budgets)
    if w and limit is not None and err > limit:
        reasons.append(
            f"|err| {err:.3g} > budget {limit:.3g} at global {tuple(w['global_index'])} "
            f"(local {tuple(w['local_index'])}): expected {w['expected']:.10g}, got {w['got']:.10g}"
        )
    return f"{where}: {'; '.join(reasons) or 'failed'}"


def _coords(coords: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in coords.items())


def merge_ranks(per_rank: list[dict], expected_ranks: list[int]) -> dict:
    """Fold every rank's result for one check into the row's status, errors and mismatch."""
    seen = {r["rank"] for r in per_rank}
    missing = [r for r in expected_ranks if r not in seen]
    per_rank = ranks_agree(_precision_on_some_ranks_fails(per_rank))
    status = max((r["status"] for r in per_rank), key=STATUS_ORDER.__getitem__, default=Status.ERROR)
    if missing:
        status = Status.ERROR

    def worst(key: str):
        return max((r[key] for r in per_rank if r.get(key) is not None), default=None)

    # budget and err_naive belong to the worst element's row: take them from the rank with the largest ratio
    judged = max(
        (r for r in per_rank if r.get("budget") is not None),  # err_ratio None: infinite
        key=lambda r: math.inf if r.get("err_ratio") is None else r["err_ratio"],
        default={},
    )
    # The likely cause first: errors a peer's failure caused ("connection closed by peer") come last.
    bad = sorted(
        (r for r in per_rank if r["status"] in NOT_PASSING),
        key=lambda r: (bool(r.get("secondary")), -STATUS_ORDER[r["status"]], -(r.get("err_ratio") or 0), r["rank"]),
    )
    row = {
        "status": status,
        **{key: worst(key) for key in ("max_abs_err", "max_rel_err")},
        **{key: judged.get(key) for key in ("budget", "err_ratio", "err_naive")},
        "mismatch": _mismatch(bad[0]) if bad else None,
        "message": _message(per_rank, bad, missing, status),
        **merge_measurements(per_rank),
        "per_rank": [
            {k: r.get(k) for k in ("rank", "coords", "status", "max_abs_err", "err_ratio")}
            for r in sorted(per_rank, key=lambda r: r["rank"])
        ],
    }
    row.update(cause_fields(bad, missing))
    # where the check's rule comes from (shardcheck.harness.core.rules): the worst rank's, whose finding the row
    # reports (a rank within float32's budget of a float64 item cites the precision rule; its wrong peer, the check's)
    ruled = [r for r in bad + per_rank if r.get("rule_source")]
    row.update({k: ruled[0][k] if ruled else None for k in ("rule_source", "rule_cite")})
    # the gradient convention every rank matched (Case.grad_conventions), where a case accepts more than one
    conventions = {r.get("grad_convention") for r in per_rank}
    if conventions - {None}:
        row["grad_convention"] = conventions.pop() if len(conventions) == 1 else None
    return row


def _precision_on_some_ranks_fails(per_rank: list[dict]) -> list[dict]:
    """`per_rank` with a precision warning turned into a failure on values where other ranks pass: float32 or bfloat16
    math shows on every rank, an error on some ranks only (others exact) is a bug."""
    precision = [r for r in per_rank if r["status"] == Status.WARN and rank_symptom(r).startswith("precision:")]
    if not (precision and any(r["status"] == Status.PASS for r in per_rank)):
        return per_rank
    return [
        {
            **r,
            "status": Status.FAIL,
            "symptom": Symptom.VALUES,
            "message": "only some ranks are off (a precision choice would show on every rank): " + r["message"],
        }
        if r in precision
        else r
        for r in per_rank
    ]


def _mismatch(worst: dict) -> dict:
    """Where the likely cause's rank went wrong: its element (non-finite first), or the kind of its error."""
    loc = worst.get("nonfinite") or worst.get("worst") or {}
    return {
        "rank": worst["rank"],
        "coords": worst["coords"],
        "global_index": loc.get("global_index"),
        "local_index": loc.get("local_index"),
        "expected": loc.get("expected"),
        "got": loc.get("got"),
        "kind": "error"
        if worst["status"] == Status.ERROR
        else ("nonfinite" if worst.get("nonfinite") else "shape" if "shape_mismatch" in worst else "value"),
    }


def _message(per_rank: list[dict], bad: list[dict], missing: list[int], status: Status) -> str:
    """The row's message: the likely cause's rank described and every failing and missing rank named; else, on a skip
    or where a rank asked to keep it, the ranks' own message."""
    parts = [describe(r) for r in bad[:1]]
    if bad:
        parts.append(f"failing rank(s): {', '.join(map(str, sorted({r['rank'] for r in bad})))}")
    if missing:
        parts.append(f"no result from rank(s) {', '.join(map(str, missing))}")
    if not parts and (status == Status.SKIP or any(r.get("keep_message") for r in per_rank)):
        # the reason the ranks gave (the same on every rank), or what a passing rank asked to record (e.g. what it
        # raised)
        parts = [next((r["message"] for r in per_rank if r.get("message")), "")]
    return "; ".join(parts)


def rank_symptom(rank_result: dict) -> str:
    """What went wrong on one rank (a key of shardcheck.harness.core.records.SYMPTOMS): as the worker named it, else
    from the check and what the comparison found."""
    if rank_result.get("symptom"):
        return rank_result["symptom"]
    check = str(rank_result.get("check", ""))
    if rank_result["status"] == Status.ERROR:
        return "exception" if rank_result.get("error_type") else "missing"
    if check == "property:comm":
        return "comm"
    if check == "property:signature":
        return "signature"
    if check.startswith("property:"):
        return "property"
    if rank_result.get("nonfinite"):
        return "nonfinite"
    return "shape" if "shape_mismatch" in rank_result else "values"


def cause_fields(bad: list[dict], missing: list[int]) -> dict:
    """The structured cause of a merged row (shardcheck.harness.core.records.ResultRow): `bad` its not-passing rank
    results, likely cause first, `missing` the ranks that reported nothing.  The culprits are the ranks with the cause's
    status that failed on their own; the ranks whose error followed a peer's failure, and those that reported
    nothing, are blocked."""
    if not bad:
        return {
            "symptom": Symptom.MISSING if missing else None,
            "culprit_ranks": list(missing),
            "blocked_ranks": [],
            "error_type": None,
            "error_message": None,
            "error_where": None,
            "phase": None,
        }
    first = bad[0]
    primary = [r for r in bad if not r.get("secondary")]
    if not primary:  # every rank that failed did so after a peer: the cause is elsewhere in the item
        return {
            "symptom": Symptom.BLOCKED,
            "culprit_ranks": [],
            "blocked_ranks": sorted({r["rank"] for r in bad} | set(missing)),
            **{key: first.get(key) for key in ("error_type", "error_message", "error_where", "phase")},
        }
    culprits = sorted({r["rank"] for r in primary if r["status"] == first["status"]}) or [first["rank"]]
    blocked = sorted(({r["rank"] for r in bad if r.get("secondary")} | set(missing)) - set(culprits))
    return {
        "symptom": rank_symptom(first),
        "culprit_ranks": culprits,
        "blocked_ranks": blocked,
        **{key: first.get(key) for key in ("error_type", "error_message", "error_where", "phase")},
    }


MEASURED_MAX = (
    "time_ms",
    "time_ms_iqr",
    "time_fwd_ms",
    "time_bwd_ms",
    "peak_bytes",
    "peak_bytes_fwd",
    "ref_time_ms",
    "ref_time_ms_iqr",
    "ref_peak_bytes",
    "expected_peak_bytes",
    "saved_bytes",
)


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
    modelled = [r for r in per_rank if r.get("expected_peak_bytes") is not None]
    if modelled or any(r.get("memory_model") for r in per_rank):  # the words of the largest model (unequal shards)
        out["memory_model"] = max(modelled or per_rank, key=lambda r: r.get("expected_peak_bytes") or 0).get(
            "memory_model"
        )
    for key in ("times_ms", "ref_times_ms", "iters", "warmup", "comm_allowed"):  # identical on every rank
        values = [r[key] for r in per_rank if r.get(key) is not None]
        if values:
            out[key] = values[0]
    return out
