"""Model cases (shardcheck.ModelCase): a parallelized model checked module by module over one training step.

The decoder example (examples/decoder_tp: torchtitan-style TP + sequence parallelism, torch's context_parallel, FSDP2)
passes at every (dp, cp, tp) of world sizes 1, 2, 4; each
broken plan (tests/broken/decoder_tp) is one finding naming its first diverging module or parameter, and its rerun
line reproduces it alone.  The guide's suite with plain local shards (docs/model-cases/plain_tp_mlp.py) passes,
names its first divergence, and a parameter whose local shape matches no layout is one error naming it."""

from __future__ import annotations

import json
import shlex

import pandas as pd
import pytest
import torch
from helpers import BROKEN, ROOT

from shardcheck import ModelCase
from shardcheck.harness.core.compare import BudgetScope, budget
from shardcheck.harness.findings import model_order
from shardcheck.harness.findings.causes import causes
from shardcheck.harness.rank.suite_loader import load_suite, suite_cases

DECODER = ROOT / "examples" / "decoder_tp"
MLP = ROOT / "docs" / "model-cases" / "plain_tp_mlp.py"  # the guide's worked example
DECODER_RUN = ("run", "--suite-path", str(DECODER), "--suite", "decoder_tp", "--case", "mha")
MLP_RUN = ("run", "--suite-path", str(MLP), "--suite", "plain_tp_mlp", "--world-sizes", "1,2")


def _first_cause(run):
    table = run.causes
    assert len(table) == 1, run.stdout[-3000:]
    return table.iloc[0]


# ---- the API, without ranks ----------------------------------------------------------------------------------------


def test_a_model_case_is_a_case_whose_outputs_follow_the_step():
    suite = load_suite("plain_tp_mlp", [str(MLP)])
    case = suite.cases()[0].case()
    names = list(case.output_names)
    assert names[:4] == ["act00:up", "act01:act", "act02:down", "act03:reduce"]  # forward order, leaves first
    assert names[5] == "loss" and names[-1] == "step:down.weight"
    dacts = [n for n in names if n.startswith("dact")]
    assert dacts[-1].endswith(":up") and len(dacts) == 5  # backward order: the first module's output last
    assert {f"dparam:{p}" for p in ("up.weight", "up.bias", "down.weight")} <= set(names)
    assert all(f"param:{p}" in case.make_inputs(torch.Generator().manual_seed(3)) for p in ("up.weight", "down.weight"))
    assert case.budget_scope == BudgetScope.TENSOR


def test_suites_may_return_model_cases_and_a_bad_one_is_one_line():
    cases = suite_cases("plain_tp_mlp", quick=False, suite_paths=[str(MLP)])
    assert [c.case_id for c in cases] == ["tp", "no-layouts", "no-allreduce"]
    with pytest.raises(ValueError, match="optimizer 'adam'"):
        ModelCase(
            op="f.g",
            case_id="x",
            build=lambda g: torch.nn.Linear(2, 2),
            parallelize=lambda m, c: m,
            make_inputs=lambda g: {"tokens": torch.randn(2, 2, generator=g)},
            optimizer="adam",
        ).case()


def test_step_order_and_the_summary_name_the_first_divergence():
    checks = ["forward:dparam:w", "forward:act12:b.c", "forward:act03:a", "forward:dact01:a", "forward:loss"]
    assert sorted(checks, key=model_order.step_order)[0] == "forward:act03:a"
    assert model_order.step_order("grad:logits") is None and model_order.summary(["forward", "grad:x"]) is None
    text = model_order.summary(checks)
    assert text.startswith("first diverging: module a (output, forward) [forward:act03:a]; 4 check(s) after it")
    assert "1 parameter(s) wrong after it" in text
    only_params = model_order.summary(["forward:step:n.weight", "forward:dparam:n.weight", "forward:dparam:m.weight"])
    assert only_params.startswith("first diverging: parameter n.weight (gradient)")
    assert "wrong parameters: n.weight, m.weight" in only_params  # in the order of the case's outputs


def test_the_first_divergence_and_the_worst_name_one_parameter():
    # two parameters wrong, the second by more: the line names the first in the case's output order, both halves
    def row(check, ratio=None, tp=2, rank=0):
        status = "fail" if ratio else "pass"
        return {
            "op": "m.parallelize",
            "case_id": "c",
            "status": status,
            "check": check,
            "dp": 1,
            "cp": 1,
            "tp": tp,
            "dtype": "float64",
            "params": {"model": True},
            "err_ratio": ratio,
            "mismatch": None,
            "message": f"rank {rank} (dp=0, cp=0, tp={rank}): |err| {ratio}" if ratio else "",
            "rerun": "rerun",
            "symptom": "values" if ratio else None,
            "culprit_ranks": [rank],
            "blocked_ranks": [],
            "error_type": None,
            "error_message": None,
            "error_where": None,
            "phase": None,
        }

    wrong = {
        "forward:dparam:a.weight": (5.0, 1),
        "forward:dparam:b.weight": (50.0, 0),
        "forward:step:a.weight": (3.0, 1),
        "forward:step:b.weight": (30.0, 0),
    }
    rows = [row(check, ratio, rank=rank) for check, (ratio, rank) in wrong.items()]
    rows += [row("forward:dparam:a.weight", 4.0, rank=0)]  # the same check on another rank: not its worst
    rows += [row(c, tp=2) for c in ("forward:act00:x", "forward:loss")]
    rows += [row(c, tp=1) for c in (*wrong, "forward:act00:x", "forward:loss")]
    failing = [r for r in rows if r["status"] == "fail"]
    assert model_order.first_check([r["check"] for r in failing]) == "forward:dparam:a.weight"
    assert model_order.first_row(failing, lambda r: r["err_ratio"]) is rows[0]
    table = causes(pd.DataFrame(rows))
    assert len(table) == 1
    cause = table.iloc[0]
    assert cause.checks.startswith("first diverging: parameter a.weight (gradient) [forward:dparam:a.weight]")
    assert "wrong parameters: a.weight, b.weight" in cause.checks
    assert cause.worst.startswith("[forward:dparam:a.weight] err/budget 5: rank 1 (dp=0, cp=0, tp=1)"), cause.worst


def test_a_tensor_budget_covers_rows_that_are_exact_zeros_on_one_device():
    gen = torch.Generator().manual_seed(0)
    golden = torch.randn(4, 8, generator=gen, dtype=torch.float64)
    golden[0] = 0.0  # the gradient of the first query under a causal mask
    naive = golden.float().double()
    row, _ = budget(golden, naive, torch.float32)
    whole, _ = budget(golden, naive, torch.float32, BudgetScope.TENSOR)
    assert float(row[0].max()) == 0.0 and float(whole[0].min()) > 0.0
    assert torch.all(whole[1:] >= row[1:])


# ---- runs ----------------------------------------------------------------------------------------------------------


def _topologies(rows) -> set[str]:
    return {f"dp{dp}-cp{cp}-tp{tp}" for dp, cp, tp in zip(rows["dp"], rows["cp"], rows["tp"])}


def test_decoder_plan_passes_over_every_dp_cp_tp_at_world_sizes_1_2_4(run_shardcheck):
    run = run_shardcheck(
        "run",
        "--suite-path",
        str(DECODER),
        "--suite",
        "decoder_tp",
        "--world-sizes",
        "1,2,4",
        "--dtype",
        "float64,bfloat16",
    )
    assert run.returncode == 0, run.stdout[-3000:]
    rows = run.rows
    every = {f"dp{dp}-cp{cp}-tp{tp}" for dp in (1, 2, 4) for cp in (1, 2, 4) for tp in (1, 2, 4) if dp * cp * tp <= 4}
    assert _topologies(rows) == every  # TP + SP, torch's context_parallel, FSDP2 and every mix of them
    assert set(rows["case_id"]) == {"mha", "gqa", "odd-vocab"}
    assert set(rows[rows["case_id"] == "gqa"]["tp"]) == {1, 2, 4}  # 2 key/value heads: split at TP 2, whole at TP 4
    checks = set(rows["check"])
    assert {
        "forward:loss",
        "forward:act00:tok_embeddings",
        "forward:act05:layers.0.attention.rope",
        "forward:dparam:norm.weight",
        "forward:step:output.weight",
    } <= checks
    notes = json.loads((run.out / "run.json").read_text())["shim_notes"]
    assert any(n.startswith("used shardcheck's CPU shim for torch context parallelism") for n in notes)


# the broken plans whose rerun line is run: at a cp topology, at one of a dp and a cp topology, at tp 4
RERUN_RUN = {"rotary_not_offset", "loss_local_mean_summed", "kv_heads_split_as_if_tp_divided"}


@pytest.mark.parametrize(
    "bug, case, first, params, where, sizes",
    [
        (
            "norm_grad_not_reduced",
            "mha",
            "first diverging: parameter layers.0.attention_norm.weight (gradient)",
            "wrong parameters: layers.0.attention_norm.weight, layers.1.attention_norm.weight",
            {"dp1-cp1-tp2"},
            "1,2",
        ),
        (
            "rowwise_output_partial",
            "mha",
            "first diverging: module layers.0.attention.wo (output, forward)",
            "parameter(s) wrong",
            {"dp1-cp1-tp2"},
            "1,2",
        ),
        (
            "rotary_not_offset",
            "mha",
            "first diverging: module layers.0.attention.rope (output, forward)",
            "parameter(s) wrong",
            {"dp1-cp2-tp1"},
            "1,2",
        ),
        (
            "loss_local_mean_summed",
            "mha",
            "first diverging: the loss [forward:loss]",
            "parameter(s) wrong",
            {"dp2-cp1-tp1", "dp1-cp2-tp1"},
            "1,2",
        ),
        (
            "vocab_padded_with_zeros",
            "odd-vocab",
            "first diverging: the loss [forward:loss]",
            "parameter(s) wrong",
            {"dp1-cp1-tp2"},
            "1,2",
        ),
        # 2 key/value heads at TP 4, each rank's picked round-robin: wk/wv agree, the attention's output (wo's) does not
        (
            "kv_heads_split_as_if_tp_divided",
            "gqa",
            "first diverging: module layers.0.attention.wo (output, forward)",
            "parameter(s) wrong",
            {"dp1-cp1-tp4"},
            "4",
        ),
    ],
)
def test_each_broken_plan_is_one_finding_at_its_first_divergence(
    shared_run, run_shardcheck, bug, case, first, params, where, sizes
):
    impl = f"decoder_tp={BROKEN / 'decoder_tp' / bug}.py"
    # (shared: test_model_chart.py draws the chart of rowwise_output_partial's run)
    run = shared_run(*DECODER_RUN[:-1], case, "--world-sizes", sizes, "--dtype", "float64", "--impl", impl)
    assert run.returncode == 1
    cause = _first_cause(run)
    assert cause.checks.startswith(first) and params in cause.checks, cause.checks
    assert cause.worst.startswith(f"[{cause.checks.split('[')[1].split(']')[0]}]")  # the same check, both halves
    assert "tp=1" in cause.worst or "tp=0" in cause.worst  # a rank and its mesh coordinates
    assert any(t in cause.worst for t in where) and _topologies(run.failed()) == where
    # its rerun line: this plan, this case, float64 and one topology it fails at
    rerun = shlex.split(cause.rerun)
    at = {rerun[i + 1] for i, a in enumerate(rerun) if a == "--topology"}
    assert impl in rerun and case in rerun and "float64" in rerun, cause.rerun
    assert len(at) == 1 and {"dp{}-cp{}-tp{}".format(*(kv.split("=")[1] for kv in t.split(","))) for t in at} <= where
    if bug not in RERUN_RUN:
        return
    # and alone reproduces it (run for one plan per kind of topology it names: the line is built the same way)
    again = run_shardcheck(*rerun[1:])
    assert again.returncode == 1 and _first_cause(again).checks.startswith(first)
    assert len(_topologies(again.rows)) == 1 and _topologies(again.rows) <= where
    assert set(again.rows["dtype"]) == {"float64"}


def test_a_plan_of_plain_local_shards_passes_and_names_its_first_divergence(run_shardcheck):
    good = run_shardcheck(*MLP_RUN, "--case", "tp")
    assert good.returncode == 0, good.stdout[-3000:]
    broken = run_shardcheck(*MLP_RUN, "--case", "no-allreduce", "--dtype", "float64")
    assert broken.returncode == 1
    assert _first_cause(broken).checks.startswith("first diverging: module reduce (output, forward)")


def test_a_parameter_matching_no_layout_is_one_error_naming_it(run_shardcheck):
    run = run_shardcheck(*MLP_RUN, "--case", "no-layouts", "--dtype", "float64")
    assert run.returncode == 1
    cause = _first_cause(run)
    assert cause.status == "error" and "ModelCaseError" in cause.kind
    assert "parameter 'up.weight': local shape (8, 8) matches no layout" in cause.worst
    assert "param_layouts" in cause.worst


def test_the_guide_shows_the_example_file_and_nothing_else():
    import re

    guide = (ROOT / "docs" / "model-cases.md").read_text()
    blocks = re.findall(r"<!-- file: (\S+) -->\n```python\n(.*?)```\n", guide, re.S)
    assert {path for path, _ in blocks} == {"docs/model-cases/plain_tp_mlp.py"}
    assert "\n\n\n".join(code.strip("\n") for _, code in blocks) + "\n" == MLP.read_text()
