"""A model suite written from docs/model-cases.md alone (tests/guide_models/residual_mlp.py: pre-norm residual MLP
blocks under torch's TP plan and DP over the batch, a model that is not among the examples) passes at world sizes 1
and 2, and its plan without the DP gradient all-reduce is one finding naming the first wrong parameter."""

from __future__ import annotations

from helpers import ROOT

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
