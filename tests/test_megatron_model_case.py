"""Megatron-Core's GPTModel as a model case (suites/_model_utils_megatron_gpt.py in suite model_utils_megatron): one
training step at TP 2 and 4 with sequence parallelism passes in float64, float32 and bfloat16, module by module; a plan
that never all-reduces the sequence-parallel norms' gradients (tests/broken/megatron_gpt_plan) is one finding naming the
norm's parameter, and its rerun line reproduces it alone."""

from __future__ import annotations

import contextlib
import importlib.util
import shlex

import pytest
import torch
from helpers import BROKEN

from shardcheck import ModelCase

FORWARD = "model_utils._gpt_forward_with_linear_ce_fusion"
needs_megatron = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed (pip install -e .[megatron])"
)
NOT_REDUCED = BROKEN / "megatron_gpt_plan" / "sp_norm_grad_not_reduced.py"


def test_a_step_context_is_entered_around_the_step_and_unchecked_modules_are_not_compared():
    entered = []

    @contextlib.contextmanager
    def around(ctx):
        entered.append(ctx)
        yield

    def build(gen):
        return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()

    case = ModelCase(
        op="f.plan",
        case_id="x",
        build=build,
        parallelize=lambda m, c: m,
        make_inputs=lambda g: {"tokens": torch.randn(5, 3, generator=g, dtype=torch.float64)},
        loss=lambda out, inputs, ctx: (out**2).mean(),
        step_context=around,
        unchecked_modules=("1",),
    ).case()
    assert entered == []  # the single-device step runs when its output names are first needed, not before
    names = list(case.output_names)
    assert entered == [None] and list(case.output_names) == names and entered == [None]  # once, no rank context
    assert "act00:0" in names and "act02:2" in names and not any(n.endswith(":1") for n in names)
    assert "dparam:0.weight" in names  # parameters are never unchecked
    skipped = ModelCase(
        op="f.plan",
        case_id="y",
        build=lambda g: 1 / 0,
        parallelize=lambda m, c: m,
        make_inputs=lambda g: {},
        skip_reason="needs a framework",
    ).case()
    assert skipped.output_names == ("loss",) and skipped.skip_reason == "needs a framework"  # never built


@needs_megatron
def test_the_gpt_model_passes_at_tp_2_and_4_with_sequence_parallelism(run_shardcheck):
    run = run_shardcheck(
        "run",
        "--suite",
        "model_utils_megatron",
        "--case",
        "model-untied",
        "--timeout",
        "180",
        "--topology",
        "dp=1,cp=1,tp=2",
        "--topology",
        "dp=1,cp=1,tp=4",
    )
    assert run.returncode == 0, run.stdout[-3000:]
    rows = run.rows
    assert (rows["status"] == "pass").all() and set(rows["op"]) == {FORWARD}
    assert set(zip(rows["tp"], rows["dtype"])) == {(tp, d) for tp in (2, 4) for d in ("float64", "float32", "bfloat16")}
    checks = set(rows["check"])
    # sequence-parallel activations (dim 0 of [S, B, H]), column-parallel ones, the head-split attention, the logits
    assert {
        "forward:act02:embedding",
        "forward:act19:decoder.layers.0",
        "forward:act36:decoder.final_layernorm",
        "forward:act05:decoder.layers.0.self_attention.linear_qkv",
        "forward:act39:model",
        "forward:loss",
        "forward:act08:decoder.layers.0.self_attention.core_attention.scale_mask_softmax",
        "forward:dact00:model",
    } <= checks
    assert len([c for c in checks if c.startswith("forward:dparam:")]) == 28  # every parameter, untied model
    assert len([c for c in checks if c.startswith("forward:step:")]) == 28
    assert not any("word_embeddings" in c and ":act" in c for c in checks)  # unchecked: another form under SP
    assert all(len(r) == tp for r, tp in zip(rows["per_rank"], rows["tp"]))  # every rank judged


@needs_megatron
def test_a_norm_gradient_never_all_reduced_is_one_finding_naming_the_parameter(run_shardcheck):
    args = (
        "run",
        "--suite-path",
        str(NOT_REDUCED),
        "--suite",
        "sp_norm_grad_not_reduced",
        "--world-sizes",
        "1,2",
        "--dtype",
        "float64",
        "--timeout",
        "180",
    )
    run = run_shardcheck(*args)
    assert run.returncode == 1
    table = run.causes
    assert len(table) == 1, run.stdout[-3000:]
    cause = table.iloc[0]
    first = "first diverging: parameter decoder.layers.0.input_layernorm.weight (gradient)"
    assert cause.checks.startswith(first), cause.checks
    assert "decoder.final_layernorm.weight" in cause.checks  # every sequence-parallel-tagged parameter listed
    failed = run.failed()
    assert set(failed["tp"]) == {2}
    assert not failed["check"].str.contains(r":(?:act|dact)\d").any()  # forward and activation gradients are right
    assert "forward:step:decoder.layers.0.input_layernorm.weight" in set(failed["check"])  # and the step shows it
    again = run_shardcheck(*shlex.split(cause.rerun)[1:])
    assert again.returncode == 1 and again.causes.iloc[0].checks.startswith(first)
    assert set(zip(again.rows["tp"], again.rows["dtype"])) == {(2, "float64")}
