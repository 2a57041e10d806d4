"""A model whose own math rounds to a narrower dtype than the item's (torchtitan's RoPE in float32, Mixtral's float32
routing weights): `ModelCase(compute_dtype=...)` gives the wider items that dtype's budgets and leaves the narrower
ones their own (harness/rank/judge.py, Budget.budget_dtype)."""

from __future__ import annotations

import pytest
import torch

from shardcheck.harness.core.compare import BudgetScope
from shardcheck.harness.rank.judge import Budget


def _budget(dtype: torch.dtype, compute_dtype: torch.dtype | None) -> Budget:
    gen = torch.Generator().manual_seed(7)
    gold = torch.randn(4, 8, generator=gen, dtype=torch.float64)
    return Budget(gold, gold.to(dtype), dtype, BudgetScope.TENSOR, 1.0, compute_dtype)


@pytest.mark.parametrize(
    "dtype, compute_dtype, judged_as",
    [
        (torch.float64, torch.float32, torch.float32),  # a float64 step through a float32 RoPE
        (torch.float32, torch.float32, torch.float32),
        (torch.bfloat16, torch.float32, torch.bfloat16),  # narrower than the compute dtype: its own budget
        (torch.float32, torch.bfloat16, torch.bfloat16),  # a mixed-precision policy's bf16 work on float32 masters
        (torch.float64, None, torch.float64),
    ],
)
def test_an_item_is_judged_in_the_narrower_of_its_dtype_and_the_compute_dtype(dtype, compute_dtype, judged_as):
    assert _budget(dtype, compute_dtype).budget_dtype == judged_as


def test_a_float64_item_under_a_float32_compute_dtype_gets_a_wider_budget_than_its_own():
    own, _ = _budget(torch.float64, None).full()
    under, _ = _budget(torch.float64, torch.float32).full()
    # float32's floor of ulps at the tensor's scale (about 8e-6 here) against float64's relative budget (about 3e-10)
    assert float(under.max()) > 1e4 * float(own.max()) > 0
