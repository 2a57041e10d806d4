"""A model suite written from docs/model-cases.md alone (tests/guide_models/residual_mlp.py: pre-norm residual MLP
blocks under torch's TP plan and DP over the batch, a model that is not among the examples) passes at world sizes 1
and 2, and its plan without the DP gradient all-reduce is one finding naming the first wrong parameter.  A GPT-2-like
model with learned positions (tests/guide_models/gpt2_positions: `wpe(arange(S))` has no batch dim) passes under DP
and TP with nothing declared, and its broken plans (tests/broken/gpt2_positions) are each one finding at `wpe`."""

from __future__ import annotations

import pytest
from helpers import BROKEN, ROOT

SUITE = ROOT / "tests" / "guide_models" / "residual_mlp.py"
RUN = ("run", "--suite-path", str(SUITE), "--world-sizes", "1,2", "--dtype", "float64")


def test_the_suite_from_the_guide_passes_under_tp_and_dp(run_shardcheck):
    run = run_shardcheck(*RUN, "--case", "tp-dp")
    assert run.returncode == 0, run.stdout[-3000:]
    rows = run.rows
    assert {tuple(t) for t in rows[["dp", "cp", "tp"]].values} == {(1, 1, 1), (2, 1, 1), (1, 1, 2)}
    checks = set(rows["check"])
    assert {
        "forward:act00:blocks.0.norm",
        "forward:act02:blocks.0.act",
        "forward:loss",
        "forward:dact00:head",
        "forward:dparam:blocks.0.up.weight",
        "forward:step:blocks.1.down.bias",
        "forward:step:head.weight",
    } <= checks


def test_its_plan_without_the_dp_all_reduce_names_the_first_parameter(run_shardcheck):
    run = run_shardcheck(*RUN, "--case", "no-dp-sync")
    assert run.returncode == 1
    table = run.causes
    assert len(table) == 1, run.stdout[-3000:]
    checks = table.iloc[0].checks
    assert checks.startswith("first diverging: parameter blocks.0.norm.weight (gradient)"), checks
    assert "head.bias" in checks  # every parameter is listed: none is summed over DP
    failed = run.failed()
    assert set(failed["dp"]) == {2} and not failed["check"].str.contains(r":(?:act|dact)\d").any()


GPT2 = ROOT / "tests" / "guide_models" / "gpt2_positions"  # learned positions wpe(arange(S)): no batch dim
GPT2_BROKEN = BROKEN / "gpt2_positions"
GPT2_RUN = ("run", "--suite-path", str(GPT2), "--dtype", "float64")


def test_learned_positions_without_a_batch_dim_pass_under_dp_and_tp_with_nothing_declared(run_shardcheck):
    """`wpe`'s output [S, D] is the same on every DP rank and the gradient at it each DP rank's share: judged as
    replicated over dp and its gradient as summed over dp (before: a wrong shape at dp 2, `act01:wpe`)."""
    run = run_shardcheck(*GPT2_RUN, "--case", "tp-dp", "--world-sizes", "1,2,4")
    assert run.returncode == 0, run.stdout[-3000:]
    rows = run.rows
    topologies = {tuple(t) for t in rows[["dp", "cp", "tp"]].values}
    assert topologies == {(1, 1, 1), (2, 1, 1), (1, 1, 2), (4, 1, 1), (2, 1, 2)}
    wpe = rows[rows["check"].str.fullmatch(r"forward:(?:act|dact)\d+:wpe") & (rows["dp"] > 1)]
    assert len(wpe) == 2 * 3 and set(wpe["status"]) == {"pass"}  # its output and its gradient, dp 2, 4, 2 x tp 2


def test_learned_positions_declared_replicated_have_their_gradient_summed_over_dp(run_shardcheck):
    """`activation_layouts={"wpe": REPLICATED}` says the value's layout; its gradient at dp 2 is still each DP rank's
    share, summed before it is compared (before: `dact27:wpe` failed, each rank's share against the whole)."""
    run = run_shardcheck(*GPT2_RUN, "--case", "wpe-declared", "--topology", "dp=2,cp=1,tp=1")
    assert run.returncode == 0, run.stdout[-3000:]
    assert "forward:dact27:wpe" in set(run.rows["check"])


@pytest.mark.parametrize(
    "bug, first",
    [
        ("wpe_grad_not_reduced", "first diverging: parameter wpe.weight (gradient)"),
        ("wpe_grad_averaged", "first diverging: parameter wpe.weight (gradient)"),
        ("positions_grad_summed_over_dp", "first diverging: module wpe (gradient at its output, backward)"),
    ],
)
def test_a_wrong_dp_gradient_of_the_learned_positions_is_named(run_shardcheck, bug, first):
    """The gradient at `wpe` summed over dp is still judged: each DP rank's share (the positions' weight gradient
    never summed, or averaged) is one finding at `wpe.weight`; the whole gradient on every DP rank (summed over dp
    where it arrives) is one finding at `wpe`'s output gradient."""
    impl = f"gpt2_positions={GPT2_BROKEN / bug}.py"
    run = run_shardcheck(*GPT2_RUN, "--case", "tp-dp", "--world-sizes", "1,2", "--impl", impl)
    assert run.returncode == 1
    table = run.causes
    assert len(table) == 1, run.stdout[-3000:]
    assert table.iloc[0].checks.startswith(first), table.iloc[0].checks
    failed = run.failed()
    assert set(failed["dp"]) == {2} and "forward:dparam:wpe.weight" in set(failed["check"])
    wrong_activations = set(failed["check"][failed["check"].str.contains(r":(?:act|dact)\d")])
    assert wrong_activations == ({"forward:dact27:wpe"} if bug.startswith("positions") else set())
