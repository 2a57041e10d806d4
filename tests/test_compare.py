"""The comparison engine on its own: budgets, worst element, NaN/Inf matching, merging ranks."""

from __future__ import annotations

import math

import pytest
import torch

from shardcheck.harness.core.compare import FLOOR_ULPS, KAPPA, RTOL_FLOAT64, budget, compare, judge, merge_ranks


def _gen():
    return torch.Generator().manual_seed(1234)


def test_compare_finds_worst_element_and_its_values():
    expected = torch.randn(3, 4, 5, generator=_gen(), dtype=torch.float64)
    got = expected.clone()
    got[2, 1, 3] += 0.25
    got[0, 0, 0] -= 0.125
    stats = compare(got, expected)
    assert stats["worst"]["local_index"] == [2, 1, 3]
    assert stats["max_abs_err"] == pytest.approx(0.25)
    assert stats["worst"]["expected"] == pytest.approx(float(expected[2, 1, 3]))
    assert stats["worst"]["got"] == pytest.approx(float(expected[2, 1, 3]) + 0.25)
    assert stats["nonfinite"] is None


@pytest.mark.parametrize("shape", [(), (7,), (3, 1, 5), (2, 3, 4, 5)])
def test_the_worst_element_and_worst_ratio_are_at_torchs_index_of_the_flat_argmax(shape):
    gen = _gen()
    expected = torch.randn(shape, generator=gen, dtype=torch.float64)
    got = expected + torch.randn(shape, generator=gen, dtype=torch.float64) * 1e-3
    limit = torch.rand(shape, generator=gen, dtype=torch.float64) + 0.1
    stats = compare(got, expected, limit)
    diff = (got - expected).abs()
    by_err = [int(i) for i in torch.unravel_index(diff.argmax(), shape)]
    by_ratio = [int(i) for i in torch.unravel_index((diff / limit).argmax(), shape)]
    assert stats["max_abs_err"] == float(diff.max())
    assert stats["worst"]["local_index"] == by_ratio
    assert stats["budget"] == float(limit[tuple(by_ratio)])
    assert compare(got, expected)["worst"]["local_index"] == by_err
    assert stats["nonfinite"] is None


def test_nonfinite_positions_and_signs_must_match():
    expected = torch.tensor([0.5, -math.inf, math.nan, 1.0], dtype=torch.float64)
    assert compare(expected.clone(), expected)["nonfinite"] is None  # same -inf, same NaN: fine
    flipped = torch.tensor([0.5, math.inf, math.nan, 1.0], dtype=torch.float64)
    nf = compare(flipped, expected)["nonfinite"]
    assert nf["count"] == 1 and nf["local_index"] == [1] and nf["expected"] == "-inf" and nf["got"] == "inf"
    finite_where_nan = torch.tensor([0.5, -math.inf, 0.0, 1.0], dtype=torch.float64)
    assert compare(finite_where_nan, expected)["nonfinite"]["local_index"] == [2]
    status, ratio = judge(compare(flipped, expected), budget_value=1.0)
    assert status == "fail" and ratio == math.inf


def test_shape_mismatch_fails():
    stats = compare(torch.zeros(2, 3), torch.zeros(3, 2, dtype=torch.float64))
    assert stats["shape_mismatch"] == [[2, 3], [3, 2]]
    assert judge(stats, 1.0)[0] == "fail"


def test_float64_budget_is_relative_to_scale():
    golden = torch.tensor([-300.0, 2.0, -math.inf], dtype=torch.float64)
    b, naive = budget(golden, None, torch.float64)
    assert b.shape == golden.shape and naive is None
    assert torch.allclose(b, torch.full((3,), RTOL_FLOAT64 * 300.0, dtype=torch.float64))  # tensor-wide


def test_low_precision_budget_follows_the_reference_error():
    golden = torch.randn(1000, generator=_gen(), dtype=torch.float64)
    naive = golden.to(torch.bfloat16)  # the reference's own rounding in bf16
    b, err_naive = budget(golden, naive, torch.bfloat16)
    assert float(err_naive[0]) == pytest.approx(float((naive.double() - golden).abs().max()))
    bf16 = torch.bfloat16
    expected_b = KAPPA[bf16] * float(err_naive[0]) + FLOOR_ULPS[bf16] * torch.finfo(bf16).eps * float(
        golden.abs().max()
    )
    assert float(b[0]) == pytest.approx(expected_b) and (b == b[0]).all()  # one row: one budget
    # a correct sharded op rounding the other way passes; a real error does not
    other_rounding = (golden * (1 + 2**-9)).to(torch.bfloat16)
    assert judge(compare(other_rounding, golden, b, err_naive))[0] == "pass"
    wrong = naive.clone()
    wrong[17] += 1.0
    stats = compare(wrong, golden, b, err_naive)
    assert judge(stats)[0] == "fail" and stats["worst"]["local_index"] == [17]
    assert stats["budget"] == pytest.approx(expected_b)


def test_budgets_are_per_row():
    """x100 rows beside rows of exact zeros (the gradient at masked targets): the large rows' scale
    must not lend the zero rows a budget; an error of 1 there fails, the same error on a x100 row of
    its own size passes only within that row's budget."""
    golden = torch.zeros(4, 8, dtype=torch.float64)
    golden[0] = torch.randn(8, generator=_gen(), dtype=torch.float64) * 100
    golden[2] = torch.randn(8, generator=_gen(), dtype=torch.float64)
    naive = golden.to(torch.bfloat16)
    b, err_naive = budget(golden, naive, torch.bfloat16)
    assert (b[1] == 0).all() and (b[3] == 0).all()  # golden and reference exactly 0: exact zeros required
    assert float(b[0, 0]) > 50 * float(b[2, 0])  # each row its own scale
    got = naive.clone()
    got[1, 5] = 1.0
    stats = compare(got, golden, b, err_naive)
    status, ratio = judge(stats)
    assert status == "fail" and ratio == math.inf and stats["worst"]["local_index"] == [1, 5]
    assert stats["budget"] == 0.0
    # the old tensor-wide floor would have let it through
    assert FLOOR_ULPS[torch.bfloat16] * torch.finfo(torch.bfloat16).eps * float(golden.abs().max()) > 1.0
    status, ratio = judge(compare(naive, golden, b, err_naive))  # the reference itself: well within budget
    assert status == "pass" and ratio <= 1 / KAPPA[torch.bfloat16]


def _rank(rank, status, ratio=0.5, **extra):
    return {
        "rank": rank,
        "coords": {"dp": 0, "cp": 0, "tp": rank},
        "status": status,
        "max_abs_err": ratio * 1e-9,
        "max_rel_err": 0.0,
        "budget": 1e-9,
        "err_ratio": ratio,
        **extra,
    }


def test_merge_names_the_worst_rank_and_location():
    worst = {"local_index": [0, 3], "global_index": [0, 19], "expected": -2.0, "got": -2.5}
    row = merge_ranks([_rank(0, "pass"), _rank(1, "fail", 5e8, worst=worst)], expected_ranks=[0, 1])
    assert row["status"] == "fail"
    assert row["mismatch"] == {
        "rank": 1,
        "coords": {"dp": 0, "cp": 0, "tp": 1},
        "global_index": [0, 19],
        "local_index": [0, 3],
        "expected": -2.0,
        "got": -2.5,
        "kind": "value",
    }
    assert row["message"].startswith("rank 1 (dp=0, cp=0, tp=1): |err| 0.5 > budget 1e-09 at global (0, 19)")
    assert [r["status"] for r in row["per_rank"]] == ["pass", "fail"]


def test_merge_puts_the_cause_before_consequences_and_flags_missing_ranks():
    cause = _rank(1, "error", message="RuntimeError: boom")
    consequence = _rank(0, "error", message="RuntimeError: Connection closed by peer", secondary=True)
    row = merge_ranks([consequence, cause], expected_ranks=[0, 1])
    assert row["mismatch"]["rank"] == 1 and "boom" in row["message"]
    row = merge_ranks([_rank(0, "pass")], expected_ranks=[0, 1])
    assert row["status"] == "error" and "no result from rank(s) 1" in row["message"]


def test_a_precision_warning_on_some_ranks_only_is_a_failure():
    warn = dict(
        message="float64 computed in float32 (err/budget 0.3 against the float32 budget)",
        symptom="precision:float32",
        worst={"local_index": [0], "global_index": [0], "expected": 1.0, "got": 1.000001},
    )
    row = merge_ranks([_rank(0, "warn", 5.0, **warn), _rank(1, "warn", 4.0, **warn)], expected_ranks=[0, 1])
    assert row["status"] == "warn"
    row = merge_ranks([_rank(0, "pass"), _rank(1, "warn", 5.0, **warn)], expected_ranks=[0, 1])
    assert row["status"] == "fail" and "only some ranks are off" in row["message"]


def test_a_row_cites_the_rule_of_the_rank_whose_finding_it_reports():
    """A float64 gradient within float32's budget on rank 0 (the precision rule, ours) and wrong on rank 1 (the case's
    rule, here ids outside [0, V)): the row is rank 1's failure and cites its rule, never the precision rule."""
    precise = dict(rule_source="ours", rule_cite="docs/ops/README.md#conventions-shared-by-every-family")
    masked = dict(rule_source="ours", rule_cite="docs/ops/README.md#ids-outside-the-vocab")
    warn = _rank(0, "warn", 0.3, symptom="precision:float32", message="float64 computed in float32", **precise)
    row = merge_ranks([warn, _rank(1, "fail", 5e8, symptom="values", message="|err| 0.9", **masked)], [0, 1])
    assert row["status"] == "fail" and row["rule_cite"] == masked["rule_cite"]
    row = merge_ranks([_rank(0, "pass", **masked), _rank(1, "pass", **masked)], [0, 1])
    assert row["rule_cite"] == masked["rule_cite"]
