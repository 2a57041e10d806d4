"""A model case's tensors are judged as its hooks fire (RankContext.judge_output): a rank keeps one verdict per check
and the tensors of its first failing check, never every module's output and gradient at once.  Measured on the
worker's own item (tests/model_case_memory.py, storage-based peak), and the rank's check events are the same as when
every tensor is kept and judged after the step: passing, failing, and warning (the precision step, which a
tensor-wide budget lets work from the largest error alone).

And the single-device step that names a model case's checks runs where a rank (or the bench) first needs it, never
when a suite is loaded to plan: planning the decoder suite builds no model."""

from __future__ import annotations

import json
import string
import subprocess
import sys
from collections import Counter

import pytest
from helpers import ROOT

from shardcheck.harness.core.options import RunSettings
from shardcheck.harness.driver.planner import Selection, build_plan
from shardcheck.harness.rank.suite_loader import suite_cases
from shardcheck.reference import decoder as ref

SCRIPT = ROOT / "tests" / "model_case_memory.py"

# A suite file of one model case: a 4 → 6 → 2 MLP in float64 on 3 rows, its loss the sum of squares; $family, the
# plan's lines before `return model` ($plan) and the ModelCase's further arguments ($case_args) are the test's.
TINY_MLP_SUITE = string.Template("""
import torch
from torch import nn
from shardcheck import HeadTail, KnownFailure, Layout, ModelCase

FAMILY = "$family"
IMPLEMENTATION = __file__


def parallelize(model, ctx):
$plan    return model


def build(gen):
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
    return model


def cases(quick=False):
    return [ModelCase(op=f"{FAMILY}.parallelize", case_id="c", build=build, parallelize=parallelize,
                      make_inputs=lambda gen: {"x": torch.randn(3, 4, generator=gen, dtype=torch.float64)},
                      model_inputs=("x",), loss=lambda out, inputs, ctx: (out ** 2).sum(), dtypes=("float64",),
                      $case_args)]
""")
SMALL = ("--seq", "16", "--dim", "32")


def _measure(*args: str) -> list[dict]:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *SMALL, "--events", *args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_the_kept_tensors_do_not_grow_with_the_model_and_the_checks_are_the_same():
    one, three = _measure("--layers", "1,3")
    for m in (one, three):
        kept_after = m["after the run"] - m["step alone"]  # a copy of every tensor (and its artefact piece)
        kept_arriving = m["as they arrive"] - m["step alone"]  # one tensor's judging at a time
        assert kept_arriving < kept_after / 4, m
        events = m["events"]
        assert events["as they arrive"] == events["after the run"]  # every field of every check, in the same order
        assert {e["status"] for e in events["as they arrive"]} == {"pass"}
    assert three["after the run"] - three["step alone"] > 2 * (one["after the run"] - one["step alone"])
    # judging as they arrive costs the same at 3 layers as at 1: nothing per module is kept
    assert three["as they arrive"] - three["step alone"] <= 1.1 * (one["as they arrive"] - one["step alone"])
    checks = [e["check"] for e in three["events"]["as they arrive"]]
    assert len(checks) > len(one["events"]["as they arrive"]) and checks[0] == "forward:act00:tok_embeddings"


@pytest.mark.parametrize("scale, status", [("1.5", "fail"), ("1.000000001", "warn")])
def test_failing_and_precision_warned_checks_are_the_same_judged_as_they_arrive(scale, status):
    (m,) = _measure("--layers", "1", "--scale", scale)
    events = m["events"]
    assert events["as they arrive"] == events["after the run"]
    assert Counter(e["status"] for e in events["as they arrive"]) == {status: len(events["after the run"])}
    if status == "warn":  # from the largest error alone, the same ratio as the tensors give
        assert all(
            e["message"].startswith("float64 computed in float32 (err/budget ") for e in events["as they arrive"]
        )
    # a failing step keeps the first failing tensor's piece: more than a passing step, far less than every copy
    assert m["as they arrive"] - m["step alone"] < (m["after the run"] - m["step alone"]) / 4


def test_an_exception_of_the_harness_while_judging_as_they_arrive_is_a_harness_error(run_shardcheck, tmp_path):
    suite = tmp_path / "bad_layout_mlp.py"
    # a declared layout the activation cannot take (3 rows in 2·TP chunks): the harness's slicing raises
    suite.write_text(
        TINY_MLP_SUITE.substitute(
            family="bad_layout_mlp", plan="", case_args='activation_layouts={"1": Layout(tp=HeadTail(0))}'
        )
    )
    run = run_shardcheck(
        "run",
        "--suite-path",
        str(suite),
        "--suite",
        "bad_layout_mlp",
        "--world-sizes",
        "2",
        "--topology",
        "dp=1,cp=1,tp=2",
    )
    assert run.returncode == 1
    rows = run.rows.set_index("check")
    assert rows.loc["forward:act00:0", "status"] == "pass"  # judged before the output whose slicing raised
    bad = rows.loc["forward:act01:1"]
    assert bad["status"] == "error" and "shardcheck's own code raised" in bad["message"]
    assert "harness" in bad["symptom"] and bad["error_where"].startswith("harness/core/")
    assert set(rows.loc[[c for c in rows.index if c >= "forward:act01"], "status"]) == {"error"}


# ---- the single-device step, run where it is needed -----------------------------------------------------------------


def test_planning_runs_no_model_and_the_names_are_made_once_where_needed(monkeypatch):
    built = []
    real_build = ref.build
    monkeypatch.setattr(ref, "build", lambda cfg, gen: built.append(cfg) or real_build(cfg, gen))
    plan = build_plan(
        Selection(
            run_id="lazy",
            settings=RunSettings(device="cpu", backend="gloo", timeout=60.0, seed=0),
            suites_wanted=["decoder"],
            world_sizes=[1, 2, 4],
        )
    )
    assert len(plan.items) == 30 and {tuple(i.checks) for i in plan.items} == {("forward:loss",)}
    assert not any(i.skip for i in plan.items)  # its batch laid out at every topology, from the data alone
    (case,) = suite_cases("decoder", quick=False)  # what a rank loads
    assert built == []  # neither the planner nor loading the suite built (let alone ran) the model
    names = case.output_names  # a rank's golden (or the bench) asks: the single-device step runs now
    assert names[0] == "act00:tok_embeddings" and "forward:loss" in case.forward_checks and built
    steps = len(built)
    assert case.output_names == names and len(case.output_layouts) == len(names) and len(built) == steps  # once


def test_the_bench_of_a_model_case_runs_its_step(run_shardcheck):
    run = run_shardcheck(
        "run",
        "--bench",
        "--suite",
        "decoder",
        "--topology",
        "dp=1,cp=1,tp=2",
        "--dtype",
        "float64",
        "--bench-iters",
        "2",
    )
    assert run.returncode == 0, run.stdout[-3000:]
    bench = run.rows[run.rows["check"] == "bench"]
    assert len(bench) == 1 and bench["status"].iloc[0] == "pass" and bench["time_ms"].iloc[0] > 0


def test_a_model_that_cannot_be_built_is_planned_and_is_one_error_at_its_line(run_shardcheck, tmp_path):
    suite = tmp_path / "unbuildable.py"
    suite.write_text("""
import torch
from shardcheck import ModelCase

FAMILY = "unbuildable"
IMPLEMENTATION = __file__


def parallelize(model, ctx):
    return model


def build(gen):
    raise RuntimeError("no such checkpoint")  # the line a finding names


def cases(quick=False):
    return [ModelCase(op=f"{FAMILY}.parallelize", case_id="c", build=build, parallelize=parallelize,
                      make_inputs=lambda gen: {"x": torch.randn(3, 4, generator=gen, dtype=torch.float64)},
                      model_inputs=("x",), dtypes=("float64",))]
""")
    run = run_shardcheck(
        "run",
        "--suite-path",
        str(suite),
        "--suite",
        "unbuildable",
        "--world-sizes",
        "1,2",
        "--topology",
        "dp=1,cp=1,tp=1",
        "--topology",
        "dp=1,cp=1,tp=2",
    )
    assert run.returncode == 1 and "Traceback" not in run.stderr
    rows = run.rows
    assert set(rows["check"]) == {"forward:loss"} and set(rows["status"]) == {"error"} and len(rows) == 2
    (cause,) = run.causes.itertuples()
    assert "reference failed" in cause.kind  # the single-device side, on the ranks, not a usage error at load
    assert f"raised RuntimeError in setup at {suite}:14: no such checkpoint" in cause.worst  # the line that raised
    assert set(rows["error_where"]) == {f"{suite}:14"}


@pytest.mark.parametrize("patterns, code", [(("forward:*",), 0), (("forward:act*:3",), 2)])
def test_a_model_cases_known_failure_marks_its_checks_and_a_typo_is_one_usage_line(
    run_shardcheck, tmp_path, patterns, code
):
    """A model case's check names come from one step of the model: for a marked case the planner runs it, so a
    pattern that matches none of them (module "3" does not exist) is still one line and exit 2."""
    suite = tmp_path / "known_mlp.py"
    # a plan that scales the last layer's output on every rank: wrong from that layer on
    suite.write_text(
        TINY_MLP_SUITE.substitute(
            family="known_mlp",
            plan="    model[2].register_forward_hook(lambda module, args, out: out * 1.5)\n",
            case_args=f'xfail=KnownFailure("the last layer is scaled", checks={patterns!r})',
        )
    )
    run = run_shardcheck(
        "run", "--suite-path", str(suite), "--suite", "known_mlp", "--world-sizes", "1", "--topology", "dp=1,cp=1,tp=1"
    )
    assert run.returncode == code, run.stdout[-2000:] + run.stderr[-2000:]
    if code == 2:
        (line,) = run.stderr.strip().splitlines()
        assert "KnownFailure check pattern 'forward:act*:3' matches none of its checks" in line, line
        return
    rows = run.rows.set_index("check")
    assert rows.loc["forward:act00:0", "status"] == "pass" and rows.loc["forward:act02:2", "status"] == "xfail"
    assert rows.loc["forward:loss", "status"] == "xfail"
