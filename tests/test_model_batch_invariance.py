"""Batch invariance of a model case (ModelCase.batch_invariance, harness/core/model_batch_invariance.py): the suite
tests/model_cases/per_sample/ (TP + FSDP2) keeps every sample's module outputs bit for bit with its batch permuted and
split in float64, float32 and bfloat16; its broken plan (a norm streamed over the batch, NeMo-RL#1227's mechanism)
passes every value check and is one finding, naming the first block's norm and a sample."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from helpers import BROKEN, ROOT

from shardcheck.harness.core.model_batch_invariance import BatchInvariance, _compare, _verdict, model_batch_invariance

SUITE = ROOT / "tests" / "model_cases" / "per_sample"
RUN = ("run", "--suite-path", str(SUITE), "--suite", "per_sample", "--topology", "dp=2,cp=1,tp=2")
CHECKS = {"property:batch_invariant:permuted", "property:batch_invariant:split"}


def test_the_plan_keeps_every_sample_its_own_in_every_dtype(run_shardcheck):
    run = run_shardcheck(*RUN, "--dtype", "float64,float32,bfloat16")
    assert run.returncode == 0, run.stdout[-3000:]
    rows = run.rows
    mine = rows[rows["check"].isin(CHECKS)]
    assert len(mine) == 2 * 3 and set(mine["status"]) == {"pass"}  # both checks in each dtype, every rank agreeing


def test_a_norm_streamed_over_the_batch_is_named_by_its_module_and_sample(run_shardcheck):
    impl = f"per_sample={BROKEN / 'per_sample' / 'norm_streamed_over_the_batch.py'}"
    run = run_shardcheck(*RUN, "--dtype", "float64", "--impl", impl)
    assert run.returncode == 1
    failed = run.failed()
    assert set(failed["check"]) == CHECKS  # the step's values all pass: only the property sees it
    (cause,) = run.causes.itertuples()
    assert "module blocks.0.norm: sample " in cause.worst and "bit for bit" in cause.worst, cause.worst
    assert "per_sample.parallelize" in cause.op


def _rows(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_a_module_whose_dim_0_is_not_the_batch_is_not_compared():
    """A [S, B, H] output with S equal to the batch's rows: its dim 0 does not halve with the batch, so its rows are
    positions, not samples (comparing them would fail a correct plan)."""
    x, seq_first = _rows(4, 3, seed=0), _rows(4, 4, 3, seed=1)  # 4 samples; 4 positions x 4 samples
    order = torch.arange(4).roll(1).flip(0)
    want = {"mlp": x, "attention": seq_first}
    permuted = {"mlp": x[order], "attention": seq_first[:, order]}
    halves = [{"mlp": x[:2], "attention": seq_first[:, :2]}, {"mlp": x[2:], "attention": seq_first[:, 2:]}]
    moved, split = _compare(want, permuted, halves, torch.argsort(order))
    assert set(moved) == set(split) == {"mlp"}
    assert not any(bool(r.any()) for r in (*moved.values(), *split.values()))


def test_the_first_module_that_changes_is_named_with_the_sample_s_global_index():
    changes = {
        name: torch.tensor(rows, dtype=torch.float64)
        for name, rows in (("embed", [0.0, 0, 0]), ("norm", [0, 2e-16, 0]), ("head", [1e-3, 0, 0]))
    }
    samples = torch.tensor([5, 6, 7])  # this rank's rows of the batch
    bit = _verdict("permuted", changes, samples, BatchInvariance())
    assert not bit.passed and bit.value == 1e-3
    assert bit.message.startswith(
        "module norm: sample 6 (this rank's row 1) changes by 2e-16 when the batch is permuted"
    )
    assert "2 of 3 modules (bit for bit)" in bit.message
    loose = _verdict("permuted", changes, samples, BatchInvariance(atol=1e-6))
    assert not loose.passed and loose.message.startswith("module head: sample 5")
    assert _verdict("split", changes, samples, BatchInvariance(atol=1e-2)).passed


def test_a_declaration_that_permutes_nothing_the_model_reads_fails_saying_so():
    """Else the reruns would see the same batch and pass whatever the plan does."""
    case = SimpleNamespace(model_inputs=("x",), batch=None, step_context=None)
    local = {"x": _rows(4, 3, seed=2), "labels": torch.zeros(4, dtype=torch.int64)}
    ctx = SimpleNamespace(full_shapes={"x": (8, 3), "labels": (8,)})
    for spec, said in (
        (BatchInvariance(inputs=("tokens",)), "BatchInvariance inputs ['tokens'] are not inputs of the case"),
        (BatchInvariance(inputs=("labels",)), "BatchInvariance permutes ['labels'], none of the model's inputs ['x']"),
    ):
        (prop,) = model_batch_invariance(case, spec)(ctx, {}, local, ())
        assert not prop.passed and prop.message.startswith(said), prop.message
