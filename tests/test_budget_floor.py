"""Budgets with a floor from the scale of the item's tensors of the same kind (issues 41 and 42, item 5): a value that
cancels to ~0 carries the round-off of the terms that cancel, not a budget from its own round-off, while a wrong value
of a size its kind's tensors have still fails.  tests/model_cases/gpt2_attention.py: a GPT-2 attention block whose key
bias gradient is exactly zero in exact arithmetic (correct, and off by 0.01)."""

from __future__ import annotations

import torch
from helpers import ROOT

from shardcheck.harness.core.compare import SCALE_FLOOR_ULPS, BudgetScope, budget, compare, judge

GPT2 = ROOT / "tests" / "model_cases" / "gpt2_attention.py"


def _status(got: torch.Tensor, golden: torch.Tensor, limit: torch.Tensor) -> str:
    return judge(compare(got, golden, limit))[0]


def test_a_float64_value_that_cancels_gets_the_round_off_of_its_kinds_scale_not_its_own():
    gen = torch.Generator().manual_seed(5)
    golden = 1e-17 * torch.randn(16, generator=gen, dtype=torch.float64)  # a key bias gradient: round-off of ~0
    got = golden + 4e-16 * torch.randn(16, generator=gen, dtype=torch.float64)  # another order of summation
    own, _ = budget(golden, None, torch.float64)
    floored, _ = budget(golden, None, torch.float64, kind_scale=2.0)
    assert _status(got, golden, own) == "fail"  # the budget of its own scale: ~1e-27
    assert _status(got, golden, floored) == "pass"
    assert float(floored[0]) == SCALE_FLOOR_ULPS * torch.finfo(torch.float64).eps * 2.0
    assert _status(golden + 1e-6, golden, floored) == "fail"  # a wrong value far below its kind's scale still fails


def test_a_float32_residue_on_an_exact_zero_row_passes_and_exact_zeros_stay_exact():
    golden = torch.zeros(3, 8, dtype=torch.float64)
    golden[0] = torch.randn(8, generator=torch.Generator().manual_seed(6), dtype=torch.float64) * 1e-2
    naive = golden.float().double()
    naive[1, 3] = 1.4e-39  # the reference's own residue on a row the golden has exactly 0 (issue 42: budget 4.1e-38)
    limit, _ = budget(golden, naive, torch.float32, kind_scale=1e-2)
    residue = golden.clone()
    residue[1, 5] = 9.6e-33
    assert _status(residue, golden, limit) == "pass"
    wrong = golden.clone()
    wrong[1, 5] = 1e-4  # 1% of the kind's scale
    assert _status(wrong, golden, limit) == "fail"
    assert float(limit[2].max()) == 0.0  # golden and reference exact zeros (a masked target): any error fails
    whole, _ = budget(golden, naive, torch.float32, BudgetScope.TENSOR, kind_scale=1e-2)
    assert float(whole.min()) > 0.0


def test_a_correct_gpt2_block_passes_strict_and_a_wrong_key_bias_gradient_fails(run_shardcheck):
    run = run_shardcheck(
        "run", "--suite-path", str(GPT2), "--world-sizes", "1,2", "--dtype", "float64,float32", timeout=900
    )
    rows = run.rows
    right, off = rows[rows["case_id"] == "tp"], rows[rows["case_id"] == "k-bias-grad-off"]
    assert set(right["tp"]) == {1, 2} and (right["status"] == "pass").all(), right[right["status"] != "pass"]
    k_bias = right[(right["check"] == "forward:dparam:k.bias") & (right["dtype"] == "float64")]
    assert len(k_bias) == 2 and (k_bias["err_ratio"] < 0.5).all(), k_bias[["tp", "err_ratio", "budget"]]
    wrong = off[off["check"] == "forward:dparam:k.bias"]
    assert len(wrong) == 4 and (wrong["status"] == "fail").all() and (wrong["err_ratio"] > 100).all(), wrong
    assert set(off[off["status"] != "pass"]["check"]) == {"forward:dparam:k.bias", "forward:step:k.bias"}


def _one_entry_vocab_gradient() -> tuple[torch.Tensor, torch.Tensor]:
    """(upstream gradient, float32 d/dlogits of the log-probs of K ids gathered from a one-entry vocab): the ids'
    upstream gradients scattered onto the entry minus softmax (exactly 1) times their sum, two float32 sums of the
    same K terms in two orders.  Exactly 0 in exact arithmetic; off by round-off of the upstream gradient's scale."""
    gen = torch.Generator().manual_seed(7)
    upstream = torch.randn(2, 4, 4, generator=gen, dtype=torch.float64)  # [B, S, K]
    g = upstream.float()
    scattered = g[..., 3] + (g[..., 2] + (g[..., 1] + g[..., 0]))  # scatter_add, one id after another
    summed = (g[..., 0] + g[..., 1]) + (g[..., 2] + g[..., 3])  # the sum's pairwise order
    return upstream, (scattered - 1.0 * summed).double()[..., None]


def test_a_golden_of_exact_zeros_throughout_gets_a_floor_from_its_inputs_scale_and_a_wrong_zero_still_fails():
    """Issue 42, item 5: ChunkedDistributedGatherLogprob at V = 1 returned a float32 residue of 1.2e-7 where the golden
    and the reference are exact zeros (a cancellation at the upstream gradient's scale) and failed against budget 0."""
    upstream, got = _one_entry_vocab_gradient()
    assert 0 < float(got.abs().max()) < 1e-5  # the residue this floor is for (float32 round-off of g - g·1)
    golden = torch.zeros_like(got)
    scale = float(upstream.abs().max())
    without, _ = budget(golden, golden.float(), torch.float32, kind_scale=0.0)
    assert _status(got, golden, without) == "fail"  # the old budget: 0
    limit, _ = budget(golden, golden.float(), torch.float32, kind_scale=0.0, input_scale=scale)
    assert _status(got, golden, limit) == "pass"
    assert float(limit.max()) == SCALE_FLOOR_ULPS * torch.finfo(torch.float32).eps * scale
    wrong = golden.clone()
    wrong[1, 2, 0] = 1e-3 * scale  # a wrong zero: a thousandth of the upstream gradient leaking in
    assert _status(wrong, golden, limit) == "fail"
    # float64 items get float64's ulps of the same scale: the float32 residue is not float64-accurate
    limit64, _ = budget(golden, None, torch.float64, input_scale=scale)
    assert _status(got, golden, limit64) == "fail" and _status(golden, golden, limit64) == "pass"
    # a row of zeros beside nonzero rows (a masked target's gradient) keeps budget 0 whatever the inputs' scale
    masked = golden.clone()
    masked[0] = 0.25
    kept, _ = budget(masked, masked.float(), torch.float32, kind_scale=0.25, input_scale=scale)
    assert float(kept[1].max()) == 0.0
