"""The training step users run, judged as they write it: the averaged data-parallel convention (each DP rank's loss
the mean over its own rows, gradients averaged: `loss_layout=Layout(dp=Partial("avg"))`) under FSDP2's default,
DDP and FSDP1; wrapped models whose names gain a prefix, mapped back to the names build() gave; `step_context`
around the optimizer step too.  Suite: tests/model_cases/dp_avg/; broken plans: tests/broken/dp_avg/."""

from __future__ import annotations

import shlex

import pytest
import torch
from helpers import BROKEN, ROOT, cli
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.tensor import Partial
from torch.optim.optimizer import register_optimizer_step_pre_hook

from shardcheck import Layout, ModelCase
from shardcheck.harness.core.model_case import ModelCaseError
from shardcheck.harness.core.options import UsageError
from shardcheck.harness.core.topology import Topology, default_topologies
from shardcheck.harness.core.wrapped_names import OriginalNames
from shardcheck.harness.findings.common_factor import factor_text

DP_AVG = ROOT / "tests" / "model_cases" / "dp_avg"
DP_AVG_RUN = ("run", "--suite-path", str(DP_AVG), "--dtype", "float64")


def _broken(bug: str) -> str:
    return f"dp_avg={BROKEN / 'dp_avg' / bug}.py"


# ---- without ranks -------------------------------------------------------------------------------------------------


def _tiny_case(**kw) -> ModelCase:
    def build(gen):
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
        return model

    return ModelCase(
        op="tiny.parallelize",
        case_id="x",
        build=build,
        parallelize=lambda model, ctx: model,
        make_inputs=lambda gen: {"tokens": torch.randn(5, 3, generator=gen, dtype=torch.float64)},
        loss=lambda out, inputs, ctx: (out**2).mean(),
        **kw,
    )


def test_step_context_covers_the_optimizer_step():
    """An optimizer step pre-hook registered inside `step_context` fires (before: it was left before the step)."""
    fired = []

    class Around:
        def __enter__(self):
            self.handle = register_optimizer_step_pre_hook(lambda opt, args, kwargs: fired.append(type(opt).__name__))

        def __exit__(self, *exc):
            self.handle.remove()

    case = _tiny_case(step_context=lambda ctx: Around())
    assert case.case().output_names  # one step on one device, inside the context
    assert fired == ["SGD"]


def test_a_loss_layout_other_than_sum_or_avg_over_dp_cp_is_one_line():
    with pytest.raises(ModelCaseError, match=r'loss_layout dp=P\(max\).*Partial\("avg"\)'):
        _tiny_case(loss_layout=Layout(dp=Partial("max"))).case()
    with pytest.raises(ModelCaseError, match="loss_layout tp=P"):
        _tiny_case(loss_layout=Layout(tp=Partial("avg"))).case()


def test_wrapped_names_drop_each_wrappers_attribute_and_keep_a_module_named_module():
    class Wrapper(nn.Module):  # a user's own module holding a child called `module`: not a wrapper, kept
        def __init__(self):
            super().__init__()
            self.module = nn.Linear(2, 2)

    model = nn.Sequential(Wrapper())
    names = OriginalNames(model)
    assert [n for n, _ in names.parameters(model)] == ["0.module.weight", "0.module.bias"]
    compiled = torch.compile(nn.Sequential(nn.Linear(2, 2)), backend="eager")  # compiled lazily: never run here
    names = OriginalNames(compiled)
    assert [n for n, _ in names.parameters(compiled)] == ["0.weight", "0.bias"]
    assert [path for path, _ in names.modules(compiled)] == ["", "0"]  # the wrapper's path is the root's
    checkpointed = nn.Sequential(checkpoint_wrapper(nn.Linear(2, 2)), nn.Tanh())
    names = OriginalNames(checkpointed)
    assert [n for n, _ in names.parameters(checkpointed)] == ["0.weight", "0.bias"]
    assert [(path, type(m).__name__) for path, m in names.modules(checkpointed)] == [
        ("", "Sequential"),
        ("0", "Linear"),  # the module build() made, not its wrapper
        ("1", "Tanh"),
    ]


# ---- the averaged convention on ranks ------------------------------------------------------------------------------


WRAPPERS = ("fsdp2", "ddp", "fsdp1", "fsdp2-cp")
# the four wrappers' passing runs are one run (one launch per topology, not four): each test reads its case's rows
WRAPPERS_RUN = (*DP_AVG_RUN, *(a for w in WRAPPERS for a in ("--case", w)), "--world-sizes", "1,2,4")


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_the_averaged_convention_passes_at_dp_1_2_4(shared_run, wrapper):
    """Each DP rank's loss its own rows' mean, gradients averaged (FSDP2's default, DDP, FSDP1): the loss is judged as
    the ranks' mean, each activation gradient as dp times its share, the replicated positions' gradient as the ranks'
    mean; FSDP1's and DDP's prefixed names are build()'s.  Before: at dp 4 `forward:loss` expected the mean, got 4
    times it, and every activation gradient was 4 times too big; FSDP1 and DDP were refused ("is not a parameter of
    the model build() returns")."""
    run = shared_run(*WRAPPERS_RUN)
    assert run.returncode == 0, run.stdout[-3000:]
    rows = run.rows[run.rows["case_id"] == wrapper]
    assert set(rows["dp"]) == {1, 2, 4}
    checks = set(rows["check"])
    assert {"forward:loss", "forward:dact10:wpe", "forward:dparam:blocks.0.up.weight"} <= checks
    assert not any("_fsdp_wrapped_module" in c or ":module." in c for c in checks)


def test_a_compiled_model_is_judged_under_build_s_names(run_shardcheck):
    """DDP under `torch.compile` (eager backend): `_orig_mod.module.` dropped, the harness's hooks kept out of
    dynamo's tracing (before: dynamo traced into the judging and the item hung past its timeout)."""
    run = run_shardcheck(*DP_AVG_RUN, "--case", "compiled", "--topology", "dp=2,cp=1,tp=1")
    assert run.returncode == 0, run.stdout[-3000:]
    assert {"forward:act00:wpe", "forward:dparam:head.weight"} <= set(run.rows["check"])


def test_a_loss_not_averaged_is_one_finding_naming_the_loss(run_shardcheck):
    run = run_shardcheck(*DP_AVG_RUN, "--case", "ddp", "--world-sizes", "1,2", "--impl", _broken("loss_local_sum"))
    assert run.returncode == 1
    cause = run.causes.iloc[0]
    assert cause.checks.startswith("first diverging: the loss [forward:loss]"), cause.checks
    assert cause.worst.startswith("[forward:loss]")


def test_an_fsdp1_wrapped_plan_is_named_at_build_s_parameter_name(run_shardcheck):
    """FSDP1 leaving the head unsynchronized (`ignored_modules`): named `head.weight`, as build() names it."""
    run = run_shardcheck(
        *DP_AVG_RUN, "--case", "fsdp1", "--topology", "dp=2,cp=1,tp=1", "--impl", _broken("fsdp1_head_ignored")
    )
    assert run.returncode == 1
    cause = run.causes.iloc[0]
    assert cause.checks.startswith("first diverging: parameter head.weight (gradient) [forward:dparam:head.weight]")
    assert "wrong parameters: head.weight, head.bias" in cause.checks
    assert set(run.failed()["check"]) == {
        f"forward:{k}:head.{p}" for k in ("dparam", "step") for p in ("weight", "bias")
    }


# ---- one common factor ---------------------------------------------------------------------------------------------


def _row(check: str, expected: float, got: float, max_rel_err: float, dp: int = 2, dtype: str = "float64") -> dict:
    mismatch = {"expected": expected, "got": got}
    return dict(
        check=check,
        mismatch=mismatch,
        max_rel_err=max_rel_err,
        symptom="values",
        case_id="c",
        dp=dp,
        cp=1,
        tp=1,
        dtype=dtype,
    )


def test_a_common_factor_is_named_only_where_every_wrong_tensor_shares_it():
    scaled = [_row("forward:dparam:a", 1.5, 3.0, 1.0), _row("forward:dparam:b", -0.25, -0.5, 1.0)]
    stepped = _row("forward:step:a", 0.3, 0.1, 0.9)  # a wrong gradient's step: no scale of the right one, left out
    assert factor_text([*scaled, stepped]) == "every wrong tensor ×2 = dp"
    # a tensor whose worst element is twice the golden, but another element is off more: not a scale
    assert factor_text([scaled[0], _row("forward:dparam:b", 1.0, 2.0, 3.0)]) == ""
    assert factor_text([scaled[0], _row("forward:dparam:b", 1.0, 3.0, 2.0)]) == ""  # two different factors
    assert factor_text(scaled[:1]) == ""  # one tensor: one element's ratio says nothing of a common factor
    four = [_row("forward:dparam:a", 1.0, 4.0, 3.0, dp=4), _row("forward:dparam:b", 2.0, 8.0, 3.0, dp=4)]
    assert factor_text(scaled + four) == "every wrong tensor ×dp (×2 at dp2-cp1-tp1, ×4 at dp4-cp1-tp1)"
    assert factor_text([_row("forward:loss", 1.0, 0.5, 0.5), _row("forward:dact01:x", 2.0, 1.0, 0.5)]) == (
        "every wrong tensor ×0.5 = 1/dp"
    )


def test_gradients_all_dp_times_too_big_are_one_finding_that_names_the_factor(run_shardcheck):
    """FSDP2's divide factor set to 1 under the averaged convention: every parameter's gradient is dp times the
    true one, and the finding says so (before: it named the first parameter only)."""
    run = run_shardcheck(*DP_AVG_RUN, "--case", "fsdp2", "--world-sizes", "1,2,4", "--impl", _broken("grads_summed"))
    assert run.returncode == 1
    cause = run.causes.iloc[0]
    assert cause.checks.startswith(
        "first diverging: parameter wpe.weight (gradient) [forward:dparam:wpe.weight]; "
        "every wrong tensor ×dp (×2 at dp2-cp1-tp1, ×4 at dp4-cp1-tp1)"
    ), cause.checks
    failed = run.failed()
    assert set(failed["dp"]) == {2, 4} and not failed["check"].str.contains(r":(?:act|dact)\d|loss").any()


# ---- HSDP: the data mesh split replicate x shard -------------------------------------------------------------------

HSDP = ("--case", "hsdp", "--topology", "dp=4,dp_replicate=2")
# torch's own HSDP passing at 4 = 2 x 2 and at 2 = 2 x 1: one run, each test reads its topology's rows
HSDP_PASSES = (*DP_AVG_RUN, *HSDP, "--topology", "dp=2,dp_replicate=2")


def test_an_hsdp_split_is_a_topology_named_only_when_it_splits():
    assert Topology.parse("dp=4,dp_replicate=2") == Topology(4, 1, 1, dp_replicate=2)
    assert str(Topology(4, 1, 1, dp_replicate=2)) == "dp4r2-cp1-tp1" and str(Topology(4, 1, 1)) == "dp4-cp1-tp1"
    assert all(t.dp_replicate == 1 for t in default_topologies([1, 2, 4, 8]))  # only where asked for
    with pytest.raises(UsageError, match="dp_replicate=3 must divide dp=4"):
        Topology.parse("dp=4,dp_replicate=3")


def test_a_correct_hsdp_plan_passes_on_its_2d_data_mesh(shared_run):
    """`fully_shard` on ctx.data_mesh() (2 x 2 at world size 4), gradients averaged over both dims."""
    run = shared_run(*HSDP_PASSES)
    assert run.returncode == 0, run.stdout[-3000:]
    rows = run.rows
    assert set(zip(rows["dp"], rows["dp_replicate"])) == {(4, 2), (2, 2)} and len(rows[rows["dp"] == 4]) > 40


def test_an_hsdp_divide_factor_of_the_shard_group_alone_is_named_with_its_factor(run_shardcheck):
    """pytorch#155903's kind: every gradient dp_replicate times the average; the rerun line reproduces it alone."""
    run = run_shardcheck(*DP_AVG_RUN, *HSDP, "--impl", _broken("hsdp_divide_factor_shard_only"))
    assert run.returncode == 1
    cause = run.causes.iloc[0]
    assert cause.checks.startswith(
        "first diverging: parameter wpe.weight (gradient) [forward:dparam:wpe.weight]; "
        "every wrong tensor ×2 = dp_replicate = dp_shard"
    ), cause.checks
    assert (
        "at dp4r2-cp1-tp1" in cause.condition
        and "dp4r2-cp1-tp1 float64)" in cause.worst
        and "--topology dp=4,cp=1,tp=1,dp_replicate=2 " in cause.rerun
    )
    again = run_shardcheck(*shlex.split(cause.rerun)[1:])
    assert again.returncode == 1 and again.causes.iloc[0].checks == cause.checks


@pytest.mark.parametrize(
    "topology, words",
    [
        ("dp=4,dp_replicate=3", "dp_replicate=3 must divide dp=4"),
        ("dp=4,dp_replicate=0", "dp_replicate must be positive"),
    ],
)
def test_a_bad_hsdp_split_is_one_line_and_exit_2(topology, words):
    proc = cli("run", "--suite-path", str(DP_AVG), "--topology", topology)
    assert proc.returncode == 2 and words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_an_hsdp_topology_no_selected_case_runs_is_one_line_and_exit_2():
    """The plain FSDP2 case cannot use a split data mesh: refused before any rank starts, not run as plain dp."""
    proc = cli("run", "--suite-path", str(DP_AVG), "--case", "fsdp2", "--topology", "dp=4,dp_replicate=2")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        "shardcheck: error: topology dp4r2-cp1-tp1: no selected case runs a data mesh split replicate x shard "
        "(HSDP; a case opts in with hsdp=True)"
    )


def test_fsdp1_flat_parameters_are_one_error_saying_what_to_wrap_with(run_shardcheck):
    run = run_shardcheck(
        *DP_AVG_RUN, "--case", "fsdp1", "--topology", "dp=2,cp=1,tp=1", "--impl", _broken("fsdp1_flat_params")
    )
    assert run.returncode == 1
    cause = run.causes.iloc[0]
    assert cause.status == "error" and "use_orig_params=True" in cause.worst, cause.worst


def test_hsdp_with_a_shard_group_of_one_left_unsynchronized_is_named_at_the_first_parameter(shared_run, run_shardcheck):
    """verl#7493's kind at dp 2 = 2 x 1: torch's own HSDP on that mesh passes; the plan skipping it does not."""
    topology = ("--case", "hsdp", "--topology", "dp=2,dp_replicate=2")
    passes = shared_run(*HSDP_PASSES)
    assert passes.returncode == 0 and len(passes.rows[passes.rows["dp"] == 2]) > 0, passes.stdout[-3000:]
    run = run_shardcheck(*DP_AVG_RUN, *topology, "--impl", _broken("hsdp_shard_size_1_unsynced"))
    assert run.returncode == 1
    cause = run.causes.iloc[0]
    assert cause.checks.startswith("first diverging: parameter wpe.weight (gradient) [forward:dparam:wpe.weight]")
    assert not run.failed()["check"].str.contains(r":(?:act|dact)\d|loss").any()
