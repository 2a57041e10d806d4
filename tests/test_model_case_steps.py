"""The training step a model case runs (docs/model-cases.md, "The training step"): micro-batches of uneven token
counts, clipping by the global norm, several optimizer steps with the optimizer's state compared, and activation
checkpointing, each compared with the same step on one device.

The single-device step is checked against torch by hand (the micro-batches' gradients are the whole batch's, the
clipped step is torch's, AdamW's state after three steps is torch's); the suite tests/model_cases/train_step/
(TP + FSDP2) passes at dp 2 x tp 2 with every feature on; each broken plan of tests/broken/train_step/ is one finding
at the first step that shows it, and its rerun line reproduces it alone."""

from __future__ import annotations

import shlex
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers import BROKEN, ROOT

from shardcheck import Layout, ModelCase, Shard
from shardcheck.harness.core.model_case import ModelCaseError, step_order
from shardcheck.harness.core.topology import Topology
from shardcheck.harness.core.train_step import microbatches
from shardcheck.harness.rank.suite_loader import load_suite

SUITE = ROOT / "tests" / "model_cases" / "train_step"
RUN = ("run", "--suite-path", str(SUITE), "--suite", "train_step", "--topology", "dp=2,cp=1,tp=2")
sys.path.insert(0, str(SUITE))  # the suite's model, for the checks by hand

import _step_model  # noqa: E402
import _step_plan  # noqa: E402


def _suite_case(case_id: str) -> ModelCase:
    return next(c for c in load_suite("train_step", [str(SUITE)]).cases() if c.case_id == case_id)


def _case(**step) -> ModelCase:
    """The suite's model on one device, with the step's fields given (the plan's loss)."""
    checkpointed = step.pop("checkpointed", False)
    return ModelCase(
        op="train_step.parallelize",
        case_id="by-hand",
        build=lambda gen: _step_model.build(gen, checkpointed),
        parallelize=lambda model, ctx: model,
        make_inputs=_step_model.make_inputs,
        model_inputs=("x",),
        input_layouts={"x": Layout(dp=Shard(0)), "labels": Layout(dp=Shard(0))},
        loss=_step_plan.loss,
        **step,
    )


def _one_device(case: ModelCase) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    inputs = case._order_inputs()
    return case._step_on_one_device(inputs), inputs


def _model_of(inputs: dict) -> torch.nn.Module:
    model = _step_model.build(torch.Generator().manual_seed(0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(inputs["param:" + name])
    return model


# ---- the step on one device, against torch by hand -------------------------------------------------------------------


def test_the_checks_of_every_feature_are_named_in_step_order():
    names = _suite_case("steps").outputs()
    assert {"loss", "loss@mb2", "act00:blocks.0.norm@mb2", "dact00:head@mb2", "grad_norm", "loss@step3.mb2"} <= set(
        names
    )
    assert {"state:blocks.0.up.weight.exp_avg_sq", "state:head.bias.step@step2", "step:head.bias@step3"} <= set(names)
    assert not [n for n in names if n.startswith("act") and "step" in n]  # modules: in the first optimizer step only
    assert not [n for n in names if "#" in n]  # the checkpointed MLP's recomputation is not a second call
    checks = [f"forward:{n}" for n in names]
    assert sorted(checks, key=step_order) == checks  # the case's outputs are in step order
    order = [c.split(":")[1].split("@")[0] for c in checks if "@" not in c]  # the first step, first micro-batch
    assert order.index("loss") < order.index("dparam") < order.index("grad_norm") < order.index("state")
    assert step_order("forward:step:head.bias") < step_order("forward:act00:blocks.0.norm@step2")
    assert step_order("forward:dact11:blocks.0.norm@mb2") < step_order("forward:dparam:blocks.0.norm.weight")


def test_micro_batches_accumulate_the_whole_batchs_gradient_over_the_steps_tokens():
    got, inputs = _one_device(_case(microbatches=2))
    tokens = [int((inputs["labels"][j::2] != _step_model.IGNORE).sum()) for j in (0, 1)]
    assert tokens[0] != tokens[1]  # uneven: a per-micro-batch mean would weigh tokens differently
    model = _model_of(inputs)
    whole = _step_plan.loss(model(inputs["x"]), inputs, None)
    whole.backward()
    torch.testing.assert_close(got["loss"] + got["loss@mb2"], whole.detach(), rtol=1e-12, atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[f"dparam:{name}"], p.grad, rtol=1e-10, atol=1e-12)
    # micro-batch 2 is rows 1, 3, 5, 7 (its module outputs: the model on those rows)
    torch.testing.assert_close(got["act11:model@mb2"], model(inputs["x"][1::2]).detach(), rtol=1e-12, atol=0)


def test_a_ranks_piece_split_into_micro_batches_is_its_piece_of_each_micro_batch():
    case = _case(microbatches=2)
    data = _step_model.make_inputs(torch.Generator().manual_seed(1))
    shapes = {n: tuple(v.shape) for n, v in data.items()}
    whole = microbatches(case, data, shapes)
    for dp_rank in (0, 1):  # dp 2: rows 0-3, 4-7
        piece = {n: v[4 * dp_rank : 4 * dp_rank + 4] if v.dim() else v for n, v in data.items()}
        for j, mine in enumerate(microbatches(case, piece, shapes)):
            assert torch.equal(mine["x"], whole[j]["x"][2 * dp_rank : 2 * dp_rank + 2])
            assert torch.equal(mine["tokens_in_step"], data["tokens_in_step"])  # the step's count: not split


def test_clipping_is_torchs_by_the_global_norm_and_its_norm_is_a_check():
    got, inputs = _one_device(_case(clip_grad_norm=0.5))
    model = _model_of(inputs)
    _step_plan.loss(model(inputs["x"]), inputs, None).backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    torch.testing.assert_close(got["grad_norm"], norm, rtol=1e-12, atol=0)
    assert float(norm) > 0.5  # clipping scales the step
    for name, p in model.named_parameters():  # SGD at lr 0.1 on the clipped gradient
        torch.testing.assert_close(got[f"step:{name}"], p.detach() - 0.1 * p.grad * 0.5 / (norm + 1e-6))


def test_three_adamw_steps_compare_the_parameters_and_the_state_after_each():
    got, inputs = _one_device(_case(steps=3, optimizer="adamw", lr=0.01))
    model = _model_of(inputs)
    adamw = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in (1, 2, 3):
        _step_plan.loss(model(inputs["x"]), inputs, None).backward()
        adamw.step()
        adamw.zero_grad()
        where = f"@step{step}" if step > 1 else ""
        for name, p in model.named_parameters():
            torch.testing.assert_close(got[f"step:{name}{where}"], p.detach(), rtol=1e-12, atol=1e-15)
            for state in ("exp_avg", "exp_avg_sq", "step"):
                torch.testing.assert_close(got[f"state:{name}.{state}{where}"], adamw.state[p][state])
    assert float(got["state:head.weight.step@step3"]) == 3.0


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_judges_each_module_once_with_the_same_values(monkeypatch, reentrant):
    plain, _ = _one_device(_case())
    if reentrant:  # the first forward without autograd: the gradients at the MLP's modules come from the recomputation
        real = torch.utils.checkpoint.checkpoint  # (reentrant where the input requires grad: the second block)
        monkeypatch.setattr(
            _step_model, "checkpoint", lambda fn, x, use_reentrant: real(fn, x, use_reentrant=x.requires_grad)
        )
    checkpointed, _ = _one_device(_case(checkpointed=True))
    assert list(checkpointed) == list(plain)
    for name, tensor in plain.items():
        torch.testing.assert_close(checkpointed[name], tensor, rtol=1e-12, atol=1e-15)


def test_under_a_mixed_precision_policy_the_single_device_step_computes_in_bf16_on_fp32_masters():
    case = _case(mixed_precision=_step_plan.MIXED_PRECISION, checkpointed=True)
    assert case.case().dtypes == ("float32", "bfloat16")  # float64's golden is the step without the policy
    inputs = {k: v.float() if v.is_floating_point() else v for k, v in case._order_inputs().items()}
    got = case._step_on_one_device(inputs)
    exact = case._step_on_one_device(case._order_inputs())  # float64: no policy (the golden)
    assert got["act01:blocks.0.up"].dtype == torch.bfloat16 and exact["act01:blocks.0.up"].dtype == torch.float64
    model = _model_of(inputs).float()
    by_hand = model.to(torch.bfloat16)(inputs["x"].to(torch.bfloat16))  # parameters and input cast, as FSDP2 does
    torch.testing.assert_close(got["act11:model"], by_hand.detach(), rtol=0, atol=0)
    assert got["dparam:head.weight"].dtype == torch.float32  # the gradient returns to its fp32 master
    assert got["step:head.weight"].dtype == torch.float32
    assert (got["act11:model"].double() - exact["act11:model"]).abs().max() > 1e-4  # bf16's error, in the budget


def test_a_micro_batch_count_that_does_not_divide_the_batch_is_one_line():
    with pytest.raises(ModelCaseError, match=r"microbatches 3 does not divide the batch \('x' has 8 rows\)"):
        _case(microbatches=3).case()
    with pytest.raises(ModelCaseError, match="steps 0; expected a positive int"):
        _case(steps=0).case()
    with pytest.raises(ModelCaseError, match="clip_grad_norm -1"):
        _case(clip_grad_norm=-1).case()
    # dividing the batch, but not each DP rank's piece: that topology is a skip with the reason
    case = _case(microbatches=4).case()
    data = _step_model.make_inputs(torch.Generator().manual_seed(0))
    assert "a multiple of 4 rows (a multiple of microbatches·dp = 16)" in case.misfit(Topology(4, 1, 1), data)
    assert (
        case.misfit(Topology(2, 1, 2), data) == ""
        and _case(microbatches=2).case().misfit(Topology(4, 1, 1), data) == ""
    )


def test_a_suite_with_such_a_case_exits_2_and_runs_nothing(run_shardcheck, tmp_path):
    suite = tmp_path / "three_microbatches.py"
    suite.write_text(
        "import torch\nfrom shardcheck import ModelCase\n"
        "FAMILY = 'three_microbatches'\nIMPLEMENTATION = __file__\n"
        "def parallelize(model, ctx):\n    return model\n"
        "def cases(quick=False):\n"
        "    return [ModelCase(op='three_microbatches.parallelize', case_id='x', microbatches=3,\n"
        "        build=lambda g: torch.nn.Linear(2, 2), parallelize=parallelize,\n"
        "        make_inputs=lambda g: {'tokens': torch.randn(8, 2, generator=g)})]\n"
    )
    run = run_shardcheck("run", "--suite-path", str(suite), "--topology", "dp=1,cp=1,tp=1")
    assert run.returncode == 2
    lines = [line for line in (run.stdout + run.stderr).splitlines() if "error" in line]
    assert lines == [
        "shardcheck: error: suite three_microbatches: a model case raised ModelCaseError: model case "
        "three_microbatches.parallelize[x]: microbatches 3 does not divide the batch ('tokens' has 8 rows)"
    ], run.stdout + run.stderr
    assert not (run.out / "results.jsonl").exists()


# ---- runs ------------------------------------------------------------------------------------------------------------


def test_every_feature_at_once_passes_under_tp_and_fsdp2_at_world_size_4(run_shardcheck):
    run = run_shardcheck(*RUN, "--dtype", "float64,float32,bfloat16")
    assert run.returncode == 0, run.stdout[-3000:]
    rows = run.rows
    assert set(rows["case_id"]) == {"plain", "steps", "mixed-precision"}
    assert set(rows[rows["case_id"] == "mixed-precision"]["dtype"]) == {"float32", "bfloat16"}
    steps = set(rows[rows["case_id"] == "steps"]["check"])
    assert {
        "forward:loss@mb2",
        "forward:act03:blocks.0.down@mb2",
        "forward:grad_norm@step3",
        "forward:state:blocks.0.up.weight.exp_avg@step3",
        "forward:step:head.weight@step3",
    } <= steps
    assert len(steps) == len(_suite_case("steps").outputs())


def test_every_feature_at_once_passes_on_hsdp_2_by_2(run_shardcheck):
    run = run_shardcheck(
        "run",
        "--suite-path",
        str(SUITE),
        "--suite",
        "train_step",
        "--topology",
        "dp=4,dp_replicate=2",
        "--case",
        "hsdp-steps",
        "--case",
        "hsdp-mixed-precision",
        "--dtype",
        "float64,float32",
    )
    assert run.returncode == 0, run.stdout[-3000:]
    rows = run.rows
    assert set(rows["status"]) == {"pass"} and set(rows["dtype"]) == {"float64", "float32"}
    # the policy's case (not float64: its golden is the step without the policy) has every check the other has
    by_case = rows.groupby("case_id")
    assert set(by_case.get_group("hsdp-mixed-precision")["dtype"]) == {"float32"}
    assert set(by_case.get_group("hsdp-mixed-precision")["check"]) == set(by_case.get_group("hsdp-steps")["check"])
    assert {"forward:grad_norm@step3", "forward:state:blocks.0.up.weight.exp_avg@step3", "forward:loss@mb2"} <= set(
        rows["check"]
    )


def test_the_mixed_precision_plan_against_a_reference_without_the_policy_fails(run_shardcheck, tmp_path):
    """The policy's field is what makes the budgets a bf16 forward's: the same plan checked as a float32 step fails."""
    suite = tmp_path / "no_policy.py"
    suite.write_text(
        f"import sys\nsys.path.insert(0, {str(SUITE)!r})\n"
        "import train_step as base\nFAMILY = 'train_step'\n"
        f"IMPLEMENTATION = {str(SUITE / '_step_plan.py')!r}\n"
        "def cases(quick=False):\n"
        "    return [base.case('no-policy', 'parallelize_mixed_precision', dtypes=('float32',))]\n"
    )
    run = run_shardcheck("run", "--suite-path", str(suite), "--topology", "dp=2,cp=1,tp=1", strict=False)
    assert run.returncode == 1
    assert run.causes.iloc[0].checks.startswith("first diverging: module blocks.0.norm (output, forward)")


@pytest.mark.parametrize(
    "bug, first",
    [
        ("loss_mean_per_microbatch", "first diverging: the loss [forward:loss]"),
        ("clip_by_local_norm", "first diverging: the gradients' total norm (clipping) [forward:grad_norm]"),
        (
            "adam_step_counted_twice",
            "first diverging: parameter blocks.0.norm.weight (optimizer state step, step 2) "
            "[forward:state:blocks.0.norm.weight.step@step2]",
        ),
    ],
)
def test_each_broken_step_is_one_finding_at_the_first_step_that_shows_it(run_shardcheck, bug, first):
    impl = f"train_step={BROKEN / 'train_step' / bug}.py"
    run = run_shardcheck(*RUN, "--case", "steps", "--dtype", "float64", "--impl", impl)
    assert run.returncode == 1
    (cause,) = run.causes.itertuples()
    assert cause.checks.startswith(first), cause.checks
    assert cause.worst.startswith(f"[{first.split('[')[1]}")  # the same check, both halves
    rerun = shlex.split(cause.rerun)
    assert {"--case", "steps", "--dtype", "float64", "--impl", impl} <= set(rerun), cause.rerun
    if bug == "adam_step_counted_twice":  # one rerun line run (the three are of one form): it reproduces alone
        again = run_shardcheck(*rerun[1:])
        assert again.returncode == 1 and len(again.causes) == 1 and again.causes.iloc[0].checks.startswith(first)


def test_the_single_device_step_of_a_feature_matches_a_plain_loop_on_uneven_micro_batches():
    """The Hugging Face bug by hand: the per-micro-batch mean is not the step's mean when token counts differ."""
    got, inputs = _one_device(_case(microbatches=2))
    model = _model_of(inputs)
    per_mb = []
    for j in (0, 1):
        labels = inputs["labels"][j::2]
        logits = model(inputs["x"][j::2])
        per_mb.append(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=_step_model.IGNORE) / 2)
    assert abs(float(sum(per_mb).detach()) - float(got["loss"] + got["loss@mb2"])) > 1e-3
