"""A model case's tensors are judged as its hooks fire (RankContext.judge_output): a rank keeps one verdict per check
and the tensors of its first failing check, never every module's output and gradient at once.  Measured on the
worker's own item (tests/model_case_memory.py, storage-based peak), and the rank's check events are the same as when
every tensor is kept and judged after the step: passing, failing, and warning (the precision step, which a
tensor-wide budget lets work from the largest error alone)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

from helpers import ROOT

SCRIPT = ROOT / "tests" / "model_case_memory.py"
SMALL = ("--seq", "16", "--dim", "32")


def _measure(*args: str) -> list[dict]:
    done = subprocess.run([sys.executable, str(SCRIPT), *SMALL, "--events", *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
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
        assert all(e["message"].startswith("float64 computed in float32 (err/budget ")
                   for e in events["as they arrive"])
    # a failing step keeps the first failing tensor's piece: more than a passing step, far less than every copy
    assert m["as they arrive"] - m["step alone"] < (m["after the run"] - m["step alone"]) / 4


def test_an_exception_of_the_harness_while_judging_as_they_arrive_is_a_harness_error(run_shardcheck, tmp_path):
    suite = tmp_path / "bad_layout_mlp.py"
    suite.write_text('''
import torch
from torch import nn
from shardcheck import HeadTail, Layout, ModelCase

FAMILY = "bad_layout_mlp"
IMPLEMENTATION = __file__


def parallelize(model, ctx):
    return model


def cases(quick=False):
    def build(gen):
        model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
        return model

    # a declared layout the activation cannot take (3 rows in 2·TP chunks): the harness's slicing raises
    return [ModelCase(op=f"{FAMILY}.parallelize", case_id="c", build=build, parallelize=parallelize,
                      make_inputs=lambda gen: {"x": torch.randn(3, 4, generator=gen, dtype=torch.float64)},
                      model_inputs=("x",), activation_layouts={"1": Layout(tp=HeadTail(0))},
                      loss=lambda out, inputs, ctx: (out ** 2).sum(), dtypes=("float64",))]
''')
    run = run_shardcheck("run", "--suite-path", str(suite), "--suite", "bad_layout_mlp", "--world-sizes", "2",
                         "--topology", "dp=1,cp=1,tp=2")
    assert run.returncode == 1
    rows = run.rows.set_index("check")
    assert rows.loc["forward:act00:0", "status"] == "pass"  # judged before the output whose slicing raised
    bad = rows.loc["forward:act01:1"]
    assert bad["status"] == "error" and "shardcheck's own code raised" in bad["message"]
    assert "harness" in bad["symptom"] and bad["error_where"].startswith("harness/core/")
    assert set(rows.loc[[c for c in rows.index if c >= "forward:act01"], "status"]) == {"error"}
