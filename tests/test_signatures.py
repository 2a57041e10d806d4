"""Signatures of a module under test against the seed's (harness.signatures), and what suites take from it."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
import torch

from conftest import BROKEN, ROOT, assert_one_cause
from harness.plan import load_suite, suite_names
from harness.signatures import KeywordCalls, call_signature, check_names, differences, seed_module

TP2 = ("--topology", "dp=1,cp=1,tp=2", "--quick")


def seed(logits, target, chunk_size, group, inference_only=False): ...


@pytest.mark.parametrize("impl", [
    seed,
    lambda logits, target, chunk_size, group, inference_only=False, fast=True: 0,  # extra optional, last
    lambda logits, target, chunk_size, group, inference_only=False, *, fast=False: 0,  # extra keyword-only
    lambda logits, target, chunk_size, group, **kwargs: 0,  # the seed's optional one through **kwargs
])
def test_compatible_signatures_are_no_finding(impl):
    assert differences(inspect.signature(seed), inspect.signature(impl)) == ("pass", [])


@pytest.mark.parametrize("impl, reason", [
    (lambda logits, target, chunk_size, group: 0, "missing parameter(s) inference_only"),
    (lambda logits, labels, chunk_size, group, inference_only=False: 0, "parameter target renamed labels"),
    (lambda logits, target, group, chunk_size, inference_only=False: 0,
     "parameters in another order: (logits, target, group, chunk_size, inference_only), "
     "the seed has (logits, target, chunk_size, group, inference_only)"),
    (lambda logits, target, chunk_size, group, scale, inference_only=False: 0, "extra required parameter(s) scale"),
    (lambda logits, target, fast=True, chunk_size=3, group=None, inference_only=False: 0,
     "extra parameter(s) fast before the seed's chunk_size, group, inference_only: callers passing those by "
     "position reach another parameter"),
    (lambda logits, target, chunk_size, *, group, inference_only=False: 0,
     "keyword-only parameter(s) the seed takes by position: group, inference_only"),
    (lambda logits, target, chunk_size, group, inference_only: 0,
     "required parameter(s) the seed makes optional: inference_only"),
])
def test_incompatible_signatures_are_a_finding(impl, reason):
    status, reasons = differences(inspect.signature(seed), inspect.signature(impl))
    assert status == "fail" and reason in reasons


def test_autograd_functions_compare_forward_without_ctx_and_are_called_by_keyword():
    seed_mod = seed_module("model_utils")
    assert list(call_signature(seed_mod.DistributedLogprob).parameters)[:2] == ["vocab_parallel_logits", "target"]
    assert check_names("model_utils", seed_mod, ["DistributedLogprob", "ChunkedDistributedLogprob"]) == {}

    class Swapped(torch.autograd.Function):  # the seed's (x, target, start, end, group) with group first
        @staticmethod
        def forward(ctx, group, vocab_parallel_logits, target, vocab_start_index, vocab_end_index, inference_only=False):
            return vocab_parallel_logits.sum(-1) * 0 + vocab_start_index * 10 + vocab_end_index + (group == "g")

        @staticmethod
        def backward(ctx, grad):
            return None, grad, None, None, None, None

    module = type("M", (), {"DistributedLogprob": Swapped})
    found = check_names("model_utils", module, ["DistributedLogprob", "from_parallel_logits_to_logprobs"])
    assert found["DistributedLogprob"][0] == "fail" and "another order" in found["DistributedLogprob"][1]
    assert found["from_parallel_logits_to_logprobs"] == ("fail", "signature: from_parallel_logits_to_logprobs is not "
                                                                 "defined in the module under test")
    x = torch.zeros(1, 2, 3)
    out = KeywordCalls(module, seed_mod).DistributedLogprob.apply(x, torch.zeros(1, 2, dtype=torch.long), 3, 4, "g")
    assert out.tolist() == [[35.0, 35.0]]  # every argument reached its named parameter


def test_an_extra_optional_parameter_runs_clean(run_shardcheck):
    run = run_shardcheck("run", "--impl", f"model_utils={ROOT / 'tests' / 'impls' / 'extra_optional_param_model_utils.py'}",
                         "--op", "model_utils.DistributedLogprob", "--dtype", "float64", *TP2)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "property:signature" not in set(run.rows["check"]) and (run.rows["status"] == "pass").all()


def test_reordered_signature_is_one_finding_and_the_values_are_checked(run_shardcheck):
    run = run_shardcheck("run", "--impl", f"model_utils={BROKEN / 'model_utils' / 'reordered_signature.py'}",
                         "--op", "model_utils.ChunkedDistributedLogprob", "--dtype", "float64", *TP2)
    assert run.returncode == 1, run.stdout + run.stderr
    cause = assert_one_cause(run)
    assert cause["status"] == "fail" and cause["checks"] == "property:signature"
    assert "parameters in another order" in cause["kind"]
    numeric = run.rows[run.rows["check"] != "property:signature"]
    assert len(numeric) and (numeric["status"] == "pass").all()  # called by keyword: no TypeError


def test_a_missing_op_is_one_finding_and_the_other_ops_run(run_shardcheck, tmp_path):
    partial = tmp_path / "partial_model_utils.py"
    partial.write_text("from distributed_impl.model_utils import *  # noqa: F403\n"
                       "from distributed_impl.model_utils import _compute_distributed_log_softmax  # noqa: F401\n"
                       "del DistributedCrossEntropy  # noqa: F821\n")
    run = run_shardcheck("run", "--impl", f"model_utils={partial}", "--op", "model_utils.DistributedCrossEntropy",
                         "--op", "model_utils._compute_distributed_log_softmax", "--dtype", "float64", *TP2)
    assert run.returncode == 1, run.stdout + run.stderr
    cause = assert_one_cause(run)
    assert cause["op"] == "model_utils.DistributedCrossEntropy" and cause["checks"] == "property:signature"
    assert "DistributedCrossEntropy is not defined in the module under test" in cause["kind"]
    assert cause["condition"] == "of the module, found before any case ran"
    ran = run.rows[run.rows["check"] != "property:signature"]
    assert set(ran["op"]) == {"model_utils._compute_distributed_log_softmax"} and (ran["status"] == "pass").all()


def _names_taken_from_the_module(path: Path) -> set[str]:
    """Attributes a suite reads off the module under test: `impl.X`, `ctx.impl.X`, `getattr(impl, "X")`."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and (
                (isinstance(node.value, ast.Name) and node.value.id == "impl")
                or (isinstance(node.value, ast.Attribute) and node.value.attr == "impl")):
            names.add(node.attr)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                and isinstance(node.args[0], ast.Name) and node.args[0].id == "impl"
                and isinstance(node.args[1], ast.Constant)):
            names.add(node.args[1].value)
    return names


# Seed names that no case has as its op, called inside other ops' cases.
SEED_NAMES_WITHOUT_CASES = {"cp_utils": {"get_train_context"}}


def test_suites_take_only_the_seed_names_from_the_module_under_test():
    """Config classes, sampling parameters and helpers come from the suite or the reference: a module that defines
    only the seed's names must be enough."""
    ops = {family: set(names) for family, names in SEED_NAMES_WITHOUT_CASES.items()}
    for name in suite_names():
        for case in load_suite(name).cases():
            ops.setdefault(case.family, set()).add(case.name)
    for path in sorted((ROOT / "suites").glob("*.py")):
        family = next((f for f in ops if path.stem.startswith(f) or path.stem.startswith(f"_{f}")), None)
        taken = _names_taken_from_the_module(path)
        assert family is not None or not taken, path
        assert taken <= ops.get(family, set()), f"{path.name} takes {sorted(taken - ops[family])} from the module"
