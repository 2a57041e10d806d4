"""kd_loss: the reference against direct formulas, the suite on the real implementation, and
the harness failing (with the right check and rank) on each module in tests/broken/kd_loss/.

CLI runs are few and small: each launch costs seconds on a 2-core machine. Every topology
below fits one launch of world size 4.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import BROKEN, IMPLS, shardcheck

from shardcheck.reference import kd_loss as ref

TOPOS = ("--topology", "dp=1,cp=1,tp=2", "--topology", "dp=2,cp=1,tp=2")
BROKEN_RUN = ("--suite", "kd_loss", "--quick", "--dtype", "float64", *TOPOS)


# ---- the reference against direct formulas ------------------------------------------------------


def _logits(*shape, seed=0, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64) * scale


def _labels(b, s, v, ignore_index=-100, frac=0.3, seed=1):
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, v, (b, s), generator=gen)
    labels[torch.rand((b, s), generator=gen) < frac] = ignore_index
    labels[0, 0] = 1  # at least one valid token
    return labels


def _direct(student, teacher, labels, T=1.0, ignore_index=-100, denom=None):
    """F.kl_div on the valid rows: Σ_v P_v (log P_v − log Q_v), times T², summed / denom (default: count)."""
    valid = labels != ignore_index
    log_q = F.log_softmax(student[valid] / T, dim=-1)
    log_p = F.log_softmax(teacher[valid] / T, dim=-1)
    per_token = F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1) * T**2
    return per_token, per_token.sum() / (valid.sum() if denom is None else denom)


@pytest.mark.parametrize("T", [1.0, 2.0, 0.5])
@pytest.mark.parametrize("ignore_index", [-100, 0])
def test_reference_matches_kl_div(T, ignore_index):
    s, t = _logits(2, 5, 11, seed=0), _logits(2, 5, 11, seed=1)
    labels = _labels(2, 5, 11, ignore_index)
    per_token, loss = _direct(s, t, labels, T, ignore_index)
    got = ref.kd_loss_per_token(s, t, labels, ignore_index=ignore_index, temperature=T)
    torch.testing.assert_close(got, per_token, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        ref.kd_loss(s, t, labels, ignore_index=ignore_index, temperature=T), loss, rtol=1e-12, atol=1e-12
    )
    # num_batch_labels replaces the count
    torch.testing.assert_close(
        ref.kd_loss(s, t, labels, ignore_index=ignore_index, temperature=T, num_batch_labels=17),
        per_token.sum() / 17,
        rtol=1e-12,
        atol=1e-12,
    )
    assert (got >= -1e-12).all()  # a KL divergence


def test_reference_explicit_sum_and_dtypes():
    s, t = _logits(3, 4, 7, seed=2), _logits(3, 4, 7, seed=3)
    labels = torch.zeros(3, 4, dtype=torch.long)
    p, q = torch.softmax(t, -1), torch.softmax(s, -1)
    explicit = (p * (p.log() - q.log())).sum(-1).mean()
    torch.testing.assert_close(ref.kd_loss(s, t, labels), explicit, rtol=1e-12, atol=1e-12)
    # fp32_upcast: bf16 in, float32 out; without it the math stays in bf16
    assert ref.kd_loss(s.bfloat16(), t.bfloat16(), labels).dtype == torch.float32
    assert ref.kd_loss(s.bfloat16(), t.bfloat16(), labels, fp32_upcast=False).dtype == torch.bfloat16
    assert ref.kd_loss(s, t, labels, fp32_upcast=True).dtype == torch.float64


def test_reference_teacher_neg_inf():
    s, t = _logits(2, 3, 9, seed=4), _logits(2, 3, 9, seed=5)
    t[..., 3:6] = float("-inf")
    labels = torch.zeros(2, 3, dtype=torch.long)
    p, log_q = torch.softmax(t, -1), torch.log_softmax(s, -1)
    keep = p > 0  # terms with P = 0 count as 0
    expected = torch.where(keep, p * (torch.log_softmax(t, -1) - log_q), torch.zeros_like(p)).sum(-1).mean()
    s_, t_ = s.clone().requires_grad_(), t.clone().requires_grad_()
    loss = ref.kd_loss(s_, t_, labels, temperature=1.5) / 1.5**2
    torch.testing.assert_close(ref.kd_loss(s, t, labels), expected, rtol=1e-12, atol=1e-12)
    assert torch.isfinite(loss)
    loss.backward()
    assert torch.isfinite(s_.grad).all() and torch.isfinite(t_.grad).all()
    assert (t_.grad[..., 3:6] == 0).all()  # no mass, no gradient
    # student gradient = (Q − P) / T, summed over valid tokens / count
    q = torch.softmax(s / 1.5, -1)
    torch.testing.assert_close(s_.grad, (q - torch.softmax(t / 1.5, -1)) / 1.5 / 6, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("num_batch_labels", [None, 5])
def test_reference_all_ignored_is_connected_zero(num_batch_labels):
    s, t = _logits(2, 3, 8).requires_grad_(), _logits(2, 3, 8, seed=1).requires_grad_()
    labels = torch.full((2, 3), -100)
    loss = ref.kd_loss(s, t, labels, num_batch_labels=num_batch_labels)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert (s.grad == 0).all() and (t.grad == 0).all()
    assert ref.kd_loss_per_token(s, t, labels).shape == (0,)


def test_reference_rejects_bad_shapes():
    with pytest.raises(ValueError):
        ref.kd_loss(_logits(2, 3, 8), _logits(2, 4, 8), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError):
        ref.kd_loss(_logits(2, 3, 8), _logits(2, 3, 8), torch.zeros(2, 4, dtype=torch.long))


# ---- the suite's structure (no launch) -----------------------------------------------------------


def test_quick_cases_cover_modes_dp_masking_chunking():
    from shardcheck.suites import kd_loss as suite

    quick = suite.cases(quick=True)
    ops = {c.op for c in quick}
    assert ops == {"kd_loss.KDLoss", "kd_loss._infer_tp_group_from_dtensor"}
    params = [c.params for c in quick if c.op == "kd_loss.KDLoss" and c.bad_input is None]
    assert {p["mode"] for p in params} == {"dtensor", "group", "plain"}
    assert any(p["chunk_size"] for p in params) and any(not p["chunk_size"] for p in params)
    assert any(p["temperature"] != 1 for p in params) and any(p["ignore_index"] != -100 for p in params)
    assert any(p["num_batch_labels"] == "none" for p in params) and any(p["num_batch_labels"] != "none" for p in params)
    assert len(quick) <= 10
    full_ids = [c.case_id for c in suite.cases(quick=False)]
    assert len(full_ids) == len(set(full_ids))


# ---- the suite on the real implementation -------------------------------------------------------


def test_quick_suite_passes(run_shardcheck):
    """Every topology of world sizes 1, 2, 4 (tp 1, 2, 4; dp up to 4) fits one launch."""
    run = run_shardcheck("run", "--suite", "kd_loss", "--quick", "--world-sizes", "1,2,4")
    assert run.returncode == 0, run.stdout + run.stderr
    rows = run.rows
    assert (rows["status"] == "pass").all(), run.failed()[["case_id", "check", "message"]]
    assert set(rows["op"]) == {"kd_loss.KDLoss", "kd_loss._infer_tp_group_from_dtensor"}
    kd = rows[rows["op"] == "kd_loss.KDLoss"]
    for check in ("forward", "grad:student_logits"):
        assert {1, 2, 4} <= set(kd[kd["check"] == check]["tp"]), check
        assert {"float64", "float32", "bfloat16"} <= set(kd[kd["check"] == check]["dtype"])
    assert len(kd[kd["check"] == "grad:teacher_logits"])
    # the DP sum, as a property of its own, on every DP > 1 topology
    dp_sum = kd[kd["check"] == "property:dp_sum"]
    assert set(dp_sum["dp"]) == {2, 4}
    assert len(kd[kd["check"] == "property:bad_input"])
    infer = rows[rows["op"] == "kd_loss._infer_tp_group_from_dtensor"]
    assert {
        "property:infer_group:plain",
        "property:infer_group:vocab-on-tp",
        "property:infer_group:seq-on-tp",
        "property:infer_group:replicated",
        "property:infer_group:vocab-on-dp",
    } <= set(infer["check"])
    assert {1, 2, 4} <= set(infer["tp"])


# ---- broken implementations ---------------------------------------------------------------------


def _run_broken(run_shardcheck, name):
    run = run_shardcheck("run", *BROKEN_RUN, "--impl", f"kd_loss={BROKEN / 'kd_loss' / name}.py")
    assert run.returncode == 1, run.stdout + run.stderr
    rows = run.rows
    return rows[rows["op"] == "kd_loss.KDLoss"]


def _row(rows, case_prefix, check, dp, tp):
    sel = rows[
        rows["case_id"].str.startswith(case_prefix)
        & (rows["check"] == check)
        & (rows["dp"] == dp)
        & (rows["tp"] == tp)
        & ~rows["case_id"].str.endswith("-tgrad")
    ]
    assert len(sel) == 1, (case_prefix, check, dp, tp, sel[["case_id", "check"]])
    return sel.iloc[0]


def _failing_ranks(row):
    return {r["rank"] for r in row["per_rank"] if r["status"] == "fail"}


def _assert_fails_on(row, ranks):
    assert row["status"] == "fail", row["message"]
    assert row["mismatch"]["rank"] in ranks
    assert _failing_ranks(row) == ranks, row["per_rank"]
    assert f"failing rank(s): {', '.join(map(str, sorted(ranks)))}" in row["message"]


def test_broken_grad_scaled_by_tp(run_shardcheck):
    rows = _run_broken(run_shardcheck, "grad_scaled_by_tp")
    bad = rows[rows["status"] != "pass"]
    assert set(bad["check"]) <= {"grad:student_logits", "grad:teacher_logits"}  # values stay right
    assert (rows[rows["check"] == "forward"]["status"] == "pass").all()
    for prefix in ("dtensor-b4s6v37-T2", "group-b4s6v37-T1-ign0"):
        _assert_fails_on(_row(rows, prefix, "grad:student_logits", 1, 2), {0, 1})
        _assert_fails_on(_row(rows, prefix, "grad:student_logits", 2, 2), {0, 1, 2, 3})
        row = _row(rows, prefix, "grad:student_logits", 1, 2)
        assert row["mismatch"]["got"] == pytest.approx(2 * row["mismatch"]["expected"], rel=1e-9)
    # the plain (non-TP) path has no TP group: nothing to scale
    assert _row(rows, "plain-", "grad:student_logits", 1, 2)["status"] == "pass"


def test_broken_t_not_t2(run_shardcheck):
    rows = _run_broken(run_shardcheck, "t_not_t2")
    forward = rows[rows["check"] == "forward"]
    failed = set(forward[forward["status"] == "fail"]["case_id"])
    t_not_1 = {c for c in forward["case_id"] if "-T1-" not in c}
    assert failed == t_not_1 and failed  # T = 1 hides the bug; T = 2 and T = 0.5 do not
    row = _row(rows, "dtensor-b4s6v37-T2", "forward", 1, 2)
    _assert_fails_on(row, {0, 1})
    assert row["mismatch"]["got"] == pytest.approx(row["mismatch"]["expected"] / 2, rel=1e-9)  # T instead of T²
    dp_sum = _row(rows, "dtensor-b4s6v37-T2", "property:dp_sum", 2, 2)
    assert dp_sum["status"] == "fail"


def test_an_older_api_is_called_as_its_callers_call_it(tmp_path):
    """Issue 42, the pre-fix copies: KDLoss is built with the arguments a case sets away from the seed's defaults
    only, so a version older than `chunk_size` (upstream's first KD losses) is judged on the values of every case
    without chunking; passing chunk_size=0 made each of its calls a TypeError and hid its missing T² factor."""
    run = shardcheck(
        "run",
        "--suite",
        "kd_loss",
        "--op",
        "kd_loss.KDLoss",
        "--case",
        "plain-b4s6v37-T1-nbltensor-chunk0-masked",
        "--case",
        "plain-b4s6v37-T1-nbltensor-chunk3-masked-teacher-inf",
        "--topology",
        "dp=1,cp=1,tp=1",
        "--dtype",
        "float64",
        "--impl",
        f"kd_loss={BROKEN / 'kd_loss' / 'before_chunk_size.py'}",
        out=tmp_path / "run",
    )
    assert run.returncode == 1, run.stdout
    rows = run.rows
    judged = rows[rows["case_id"] == "plain-b4s6v37-T1-nbltensor-chunk0-masked"]
    assert len(judged) and (judged["status"] == "pass").all(), judged[["check", "status", "message"]]
    chunked = rows[rows["case_id"] == "plain-b4s6v37-T1-nbltensor-chunk3-masked-teacher-inf"]
    assert (chunked[chunked["check"] == "forward"]["status"] == "error").all()
    assert "unexpected keyword argument 'chunk_size'" in chunked.iloc[0]["error_message"]
    # one root, one line: the signature's, with the constructor's TypeError the suite's call by that name raised
    assert len(run.causes) == 1, run.causes["kind"].tolist()
    line = run.causes.iloc[0]
    assert (
        "missing parameter(s) chunk_size" in line["kind"] and "unexpected keyword argument 'chunk_size'" in line["kind"]
    )
    assert line["condition"] == "of the module, found before any case ran", line["condition"]


def test_broken_mean_includes_ignored(run_shardcheck):
    rows = _run_broken(run_shardcheck, "mean_includes_ignored")
    bad = rows[rows["status"] != "pass"]
    # only the per-rank mean over a masked batch shows it (num_batch_labels given: the sum is right)
    assert set(bad["case_id"]) == {c for c in rows["case_id"] if "-mean-" in c and "all-ignored" not in c}
    _assert_fails_on(_row(rows, "plain-", "forward", 1, 2), {0, 1})
    row = _row(rows, "plain-", "grad:student_logits", 1, 2)
    _assert_fails_on(row, {0, 1})
    # divided by all 16 tokens instead of the 8 valid ones: half the gradient
    assert row["mismatch"]["got"] == pytest.approx(row["mismatch"]["expected"] / 2, rel=1e-9)


def test_broken_kl_as_cross_entropy(run_shardcheck):
    rows = _run_broken(run_shardcheck, "kl_as_cross_entropy")
    forward = rows[rows["check"] == "forward"]
    with_tokens = forward[~forward["case_id"].str.contains("all-ignored")]
    assert (with_tokens["status"] == "fail").all()
    assert (forward[forward["case_id"].str.contains("all-ignored")]["status"] == "pass").all()
    # −Σ P log Q and KL differ by the teacher entropy: same student gradient, different teacher gradient
    assert (rows[rows["check"] == "grad:student_logits"]["status"] == "pass").all()
    teacher = rows[rows["check"] == "grad:teacher_logits"]
    assert len(teacher) and (teacher["status"] == "fail").all()
    row = _row(rows, "dtensor-b4s6v37-T2", "forward", 2, 2)
    _assert_fails_on(row, {0, 1, 2, 3})
    assert row["mismatch"]["got"] > row["mismatch"]["expected"]  # + entropy ≥ 0


def test_broken_chunk_drops_last(run_shardcheck):
    rows = _run_broken(run_shardcheck, "chunk_drops_last")
    # chunk 0, or a chunk dividing the valid count, is unaffected
    for prefix in ("dtensor-b4s6v37-T2-nbltensor-chunk0", "plain-", "group-b2s5v37"):
        assert (rows[rows["case_id"].str.startswith(prefix)]["status"] == "pass").all(), prefix
    # valid tokens per row (3, 3, 4, 4), chunk 3: DP rank 0 of 2 has 6 (divisible), DP rank 1 has 8 and
    # drops 2. The summed loss is wrong everywhere; the gradient only on DP rank 1, i.e. ranks 2 and 3.
    uneven = "group-b4s6v37-T1-ign0-nbltensor-chunk3"
    _assert_fails_on(_row(rows, uneven, "forward", 1, 2), {0, 1})
    _assert_fails_on(_row(rows, uneven, "forward", 2, 2), {0, 1, 2, 3})
    _assert_fails_on(_row(rows, uneven, "grad:student_logits", 1, 2), {0, 1})
    row = _row(rows, uneven, "grad:student_logits", 2, 2)
    _assert_fails_on(row, {2, 3})
    assert row["mismatch"]["coords"]["dp"] == 1 and row["mismatch"]["got"] == 0.0  # a dropped token: no gradient
    assert _row(rows, uneven, "property:dp_sum", 2, 2)["status"] == "fail"


def test_float64_computed_in_float32_is_the_seeds_fp32_upcast_not_a_finding(run_shardcheck):
    """The seed casts the logits to float32 under fp32_upcast: a float64 loss only as good as float32 (and in float32)
    passes, citing the seed, even under --strict; the same precision is still a warning where nothing allows it."""
    run = run_shardcheck(
        "run",
        "--impl",
        f"kd_loss={IMPLS / 'upcast_to_float32_kd_loss.py'}",
        "--suite",
        "kd_loss",
        "--quick",
        "--op",
        "kd_loss.KDLoss",
        "--dtype",
        "float64",
        "--topology",
        "dp=1,cp=1,tp=2",
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = run.rows
    assert (rows["status"] == "pass").all(), run.failed()[["case_id", "check", "message"]]
    allowed = rows[rows["message"].fillna("").str.contains("which the contract allows")]
    assert len(allowed) and allowed["message"].str.contains("seed: 'Cast logits to float32").all()
    assert all(p.get("fp32_upcast") for p in allowed["params"])  # fp32_upcast=False keeps the logits' dtype
