"""The golden shared by the ranks of a driver's launches (harness/rank/golden.py): rank 0 works it out and leaves it in
the run's folder, its peers and the other launches load the same tensors without running the reference; a reference
that raises raises on every rank at once; a peer whose rank 0 never leaves one works it out itself."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from shardcheck.harness.core.case import Case
from shardcheck.harness.core.layout import REPLICATED
from shardcheck.harness.core.plan_data import Item
from shardcheck.harness.rank.golden import GoldenCache, share_folder


def _case(calls: list[str], fail: bool = False, unpicklable: bool = False) -> Case:
    def make_inputs(gen: torch.Generator) -> dict[str, torch.Tensor]:
        return {"x": torch.randn(3, 5, generator=gen, dtype=torch.float64), "ids": torch.arange(3)}

    def reference(inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append("reference")
        if fail:
            raise ValueError("the reference cannot")
        return inputs["x"].exp().sum(-1), threading.Lock() if unpicklable else inputs["x"] * 2

    return Case(
        op="fam.op",
        case_id="c",
        make_inputs=make_inputs,
        reference=reference,
        run=lambda impl, ctx, local: None,
        output_names=("s", "y"),
        output_layouts=(REPLICATED, REPLICATED),
        grad_inputs=("x",),
        summed_over=("dp",),
    )


def _item(dtype: str = "bfloat16") -> Item:
    return Item(
        id=0, suite="s", op="fam.op", case_id="c", dtype=dtype, topology=(2, 1, 1), world_size=2, seed=7, checks=[]
    )


def _tensors(golden) -> list:
    state = golden.state()
    return [
        state["inputs"]["x"],
        state["inputs"]["ids"],
        *state["upstream"],
        *state["outputs"],
        state["grads"]["x"],
    ] + [
        *state["naive_outputs"],
        state["naive_grads"]["x"],
    ]


def test_rank_0_works_the_golden_out_and_its_peers_and_other_launches_load_the_same_tensors(tmp_path):
    share = share_folder(tmp_path / "workers", "run-1")
    calls: list[str] = []
    case = _case(calls)
    first = GoldenCache(share, rank=0, timeout=30).get(case, _item(), 2)
    worked_out = len(calls)
    assert worked_out == 2  # the float64 reference and the bfloat16 one
    peer = GoldenCache(share, rank=1, timeout=30).get(case, _item(), 2)
    other_launch = GoldenCache(share, rank=0, timeout=30).get(case, _item(), 2)
    assert len(calls) == worked_out  # neither ran the reference
    alone = GoldenCache().get(case, _item(), 2)  # a hand-launched rank: its own
    assert len(calls) == 2 * worked_out
    for a, b, c, d in zip(_tensors(first), _tensors(peer), _tensors(other_launch), _tensors(alone)):
        assert a.dtype == b.dtype == c.dtype == d.dtype and a.shape == b.shape == c.shape == d.shape
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)
    assert peer.inputs["x"].dtype == torch.bfloat16 and peer.upstream[0].shape == (2, 3)
    # another number of summands (another topology) is another golden, worked out by rank 0
    GoldenCache(share, rank=0, timeout=30).get(case, _item(), 1)
    assert len(calls) == 3 * worked_out
    assert len(list(share.glob("*.golden"))) == 2


def test_a_reference_that_raises_raises_on_the_peers_without_their_waiting(tmp_path):
    share = share_folder(tmp_path / "workers", "run-2")
    calls: list[str] = []
    case = _case(calls, fail=True)
    with pytest.raises(ValueError, match="the reference cannot"):
        GoldenCache(share, rank=0, timeout=30).get(case, _item(), 2)
    started = time.time()
    with pytest.raises(ValueError, match="the reference cannot"):
        GoldenCache(share, rank=1, timeout=30).get(case, _item(), 2)
    assert time.time() - started < 10 and calls == ["reference", "reference"]


def test_a_peer_whose_rank_0_leaves_nothing_works_it_out_after_the_timeout(tmp_path):
    share = share_folder(tmp_path / "workers", "run-3")
    calls: list[str] = []
    started = time.time()
    golden = GoldenCache(share, rank=1, timeout=0.3).get(_case(calls), _item("float64"), 2)
    assert time.time() - started >= 0.3 and calls == ["reference"]
    assert golden.outputs[1].shape == (3, 5) and not list(share.glob("*.golden"))  # a peer leaves none


def test_a_golden_that_cannot_be_left_sends_the_peers_to_work_it_out_at_once(tmp_path):
    share = share_folder(tmp_path / "workers", "run-4")
    calls: list[str] = []
    case = _case(calls, unpicklable=True)  # an output that does not pickle
    GoldenCache(share, rank=0, timeout=30).get(case, _item(), 2)
    started = time.time()
    peer = GoldenCache(share, rank=1, timeout=30).get(case, _item(), 2)
    assert time.time() - started < 10 and len(calls) == 4 and peer.outputs[0].shape == (3,)


def test_a_goldens_budgets_are_worked_out_once_per_tensor_and_dtype_and_equal_the_budget(monkeypatch):
    from shardcheck.harness.core.compare import BudgetScope, budget
    from shardcheck.harness.rank import judge

    golden = GoldenCache().get(_case([]), _item("bfloat16"), 2)
    worked = []
    monkeypatch.setattr(judge, "budget", lambda *a: worked.append(a) or budget(*a))
    gold, ref = golden.grads["x"], golden.naive_grads["x"]
    first = judge.Budget(gold, ref, torch.bfloat16, BudgetScope.ROW, golden.grad_scale(), kept=golden.budgets)
    again = judge.Budget(gold, ref, torch.bfloat16, BudgetScope.ROW, golden.grad_scale(), kept=golden.budgets)
    limit, err_naive = first.full()
    assert again.full()[0] is limit and len(worked) == 1  # the next topology's item: the same budgets, not redone
    expected = budget(gold, ref, torch.bfloat16, BudgetScope.ROW, golden.grad_scale())
    assert torch.equal(limit, expected[0]) and torch.equal(err_naive, expected[1])
    as_float32 = judge.Budget(gold, ref, torch.float32, BudgetScope.ROW, golden.grad_scale(), kept=golden.budgets)
    assert torch.equal(as_float32.full()[0], budget(gold, ref, torch.float32, BudgetScope.ROW, golden.grad_scale())[0])
    other = judge.Budget(gold, golden.naive_outputs[1], torch.bfloat16, BudgetScope.TENSOR, 1.0, kept=golden.budgets)
    other.full()
    assert len(worked) == 3  # another dtype, another reference tensor: worked out each
    unkept = judge.Budget(gold, ref, torch.bfloat16, BudgetScope.ROW, golden.grad_scale())
    unkept.full()
    assert len(worked) == 4
