"""Signatures of a module under test against the seed's (shardcheck.harness.rank.signatures)."""

from __future__ import annotations

import inspect

import pytest
import torch
from helpers import FIXTURES, IMPLS, assert_one_cause

from shardcheck.harness.rank.signatures import KeywordCalls, call_signature, check_names, differences, seed_module

TP2 = ("--topology", "dp=1,cp=1,tp=2", "--quick")


def seed(logits, target, chunk_size, group, inference_only=False): ...


@pytest.mark.parametrize(
    "impl",
    [
        seed,
        lambda logits, target, chunk_size, group, inference_only=False, fast=True: 0,  # extra optional, last
        lambda logits, target, chunk_size, group, inference_only=False, *, fast=False: 0,  # extra keyword-only
        lambda logits, target, chunk_size, group, **kwargs: 0,  # the seed's optional one through **kwargs
    ],
)
def test_compatible_signatures_are_no_finding(impl):
    assert differences(inspect.signature(seed), inspect.signature(impl)) == ("pass", [])


@pytest.mark.parametrize(
    "impl, reason",
    [
        (lambda logits, target, chunk_size, group: 0, "missing parameter(s) inference_only"),
        (lambda logits, labels, chunk_size, group, inference_only=False: 0, "parameter target renamed labels"),
        (
            lambda logits, target, group, chunk_size, inference_only=False: 0,
            "parameters in another order: (logits, target, group, chunk_size, inference_only), "
            "the seed has (logits, target, chunk_size, group, inference_only)",
        ),
        (lambda logits, target, chunk_size, group, scale, inference_only=False: 0, "extra required parameter(s) scale"),
        (
            lambda logits, target, fast=True, chunk_size=3, group=None, inference_only=False: 0,
            "extra parameter(s) fast before the seed's chunk_size, group, inference_only: callers passing those by "
            "position reach another parameter",
        ),
        (
            lambda logits, target, chunk_size, *, group, inference_only=False: 0,
            "keyword-only parameter(s) the seed takes by position: group, inference_only",
        ),
        (
            lambda logits, target, chunk_size, group, inference_only: 0,
            "required parameter(s) the seed makes optional: inference_only",
        ),
    ],
)
def test_incompatible_signatures_are_a_finding(impl, reason):
    status, reasons = differences(inspect.signature(seed), inspect.signature(impl))
    assert status == "fail" and reason in reasons


def test_autograd_functions_compare_forward_without_ctx_and_are_called_by_keyword():
    seed_mod = seed_module("model_utils")
    assert list(call_signature(seed_mod.DistributedLogprob).parameters)[:2] == ["vocab_parallel_logits", "target"]
    assert check_names("model_utils", seed_mod, ["DistributedLogprob", "ChunkedDistributedLogprob"]) == {}

    class Swapped(torch.autograd.Function):  # the seed's (x, target, start, end, group) with group first
        @staticmethod
        def forward(
            ctx, group, vocab_parallel_logits, target, vocab_start_index, vocab_end_index, inference_only=False
        ):
            return vocab_parallel_logits.sum(-1) * 0 + vocab_start_index * 10 + vocab_end_index + (group == "g")

        @staticmethod
        def backward(ctx, grad):
            return None, grad, None, None, None, None

    module = type("M", (), {"DistributedLogprob": Swapped})
    found = check_names("model_utils", module, ["DistributedLogprob", "from_parallel_logits_to_logprobs"])
    assert found["DistributedLogprob"][0] == "fail" and "another order" in found["DistributedLogprob"][1]
    assert found["from_parallel_logits_to_logprobs"] == (
        "fail",
        "signature: from_parallel_logits_to_logprobs is not defined in the module under test",
    )
    x = torch.zeros(1, 2, 3)
    out = KeywordCalls(module, seed_mod).DistributedLogprob.apply(x, torch.zeros(1, 2, dtype=torch.long), 3, 4, "g")
    assert out.tolist() == [[35.0, 35.0]]  # every argument reached its named parameter


def test_an_extra_optional_parameter_runs_clean(run_shardcheck):
    run = run_shardcheck(
        "run",
        "--impl",
        f"model_utils={IMPLS / 'extra_optional_param_model_utils.py'}",
        "--op",
        "model_utils.DistributedLogprob",
        "--dtype",
        "float64",
        *TP2,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "property:signature" not in set(run.rows["check"]) and (run.rows["status"] == "pass").all()


def test_reordered_signature_is_one_finding_and_the_values_are_checked(run_shardcheck):
    run = run_shardcheck(
        "run",
        "--impl",
        f"model_utils={FIXTURES / 'model_utils' / 'reordered_signature.py'}",
        "--op",
        "model_utils.ChunkedDistributedLogprob",
        "--dtype",
        "float64",
        *TP2,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    cause = assert_one_cause(run)
    assert cause["status"] == "fail" and cause["checks"] == "property:signature"
    assert "parameters in another order" in cause["kind"]
    numeric = run.rows[run.rows["check"] != "property:signature"]
    assert len(numeric) and (numeric["status"] == "pass").all()  # called by keyword: no TypeError


def test_a_missing_op_is_one_finding_and_the_other_ops_run(run_shardcheck):
    run = run_shardcheck(
        "run",
        "--impl",
        f"model_utils={FIXTURES / 'model_utils' / 'without_cross_entropy.py'}",
        "--op",
        "model_utils.DistributedCrossEntropy",
        "--op",
        "model_utils._compute_distributed_log_softmax",
        "--dtype",
        "float64",
        *TP2,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    cause = assert_one_cause(run)
    assert cause["op"] == "model_utils.DistributedCrossEntropy" and cause["checks"] == "property:signature"
    assert "DistributedCrossEntropy is not defined in the module under test" in cause["kind"]
    assert cause["condition"] == "of the module, found before any case ran"
    ran = run.rows[run.rows["check"] != "property:signature"]
    assert set(ran["op"]) == {"model_utils._compute_distributed_log_softmax"} and (ran["status"] == "pass").all()
    # printed with the module it is about and a rerun line, not as a topology and dtype it has none of
    impl = FIXTURES / "model_utils" / "without_cross_entropy.py"
    assert f"FAIL model_utils.DistributedCrossEntropy [signature] in the module under test {impl}\n" in run.stdout
    assert "dp0-cp0-tp0" not in run.stdout
    rerun = (
        "rerun: shardcheck run --suite model_utils --op model_utils.DistributedCrossEntropy --topology dp=1,cp=1,tp=1 "
        f"--dtype float64 --quick --impl model_utils={impl.resolve()}"
    )
    assert rerun in run.stdout, run.stdout


def test_the_seed_is_quoted_by_names_and_defaults_never_by_our_implementations_types():
    """Issue 42, item 4: the seed module compared with is our implementation of the seed; its annotations are ours
    (output_weight_layer: Any, output_weight: Optional[Tensor]) where the seed's API documents others, so a finding
    quotes the seed's parameter names and defaults alone, and the module under test as it is."""
    import types

    def from_parallel_hidden_states_to_logprobs(
        tensor_parallel_hidden_states: torch.Tensor,
        output_weight_layer: torch.Tensor,
        runtime_gather_output: bool,
        target: torch.Tensor,
        vocab_start_index: int,
        vocab_end_index: int,
        tp_group,
        inference_only: bool = False,
        cp_group=None,
        chunk_size=None,
    ):
        return None

    module = types.SimpleNamespace(from_parallel_hidden_states_to_logprobs=from_parallel_hidden_states_to_logprobs)
    found = check_names("model_utils", module, ["from_parallel_hidden_states_to_logprobs"])
    status, message = found["from_parallel_hidden_states_to_logprobs"]
    assert status == "fail" and "missing parameter(s) output_weight" in message
    seed_part = message.split("(seed ", 1)[1].split(", under test ", 1)[0]
    assert seed_part.startswith("from_parallel_hidden_states_to_logprobs(tensor_parallel_hidden_states, "), seed_part
    assert ":" not in seed_part and "Any" not in seed_part and "inference_only=False" in seed_part
    assert "output_weight_layer:" in message.split(", under test ", 1)[1]  # the module under test with its own types


def test_an_older_signature_is_called_with_its_own_names_and_without_the_defaults_it_lacks():
    """Issue 42 (pre-fix copies): a module whose TP group is `group` and which lacks chunk_size and sampling_params
    is called as a caller of the seed API leaving those at their defaults calls it; a call that sets one of them
    still raises the TypeError that names it (the signature row has the difference)."""
    seed_mod = seed_module("model_utils")

    def from_parallel_logits_to_logprobs(
        vocab_parallel_logits, target, vocab_start_index, vocab_end_index, group, inference_only=False, cp_group=None
    ):
        return (vocab_start_index, vocab_end_index, group, inference_only, cp_group)

    module = type("M", (), {"from_parallel_logits_to_logprobs": staticmethod(from_parallel_logits_to_logprobs)})
    call = KeywordCalls(module, seed_mod).from_parallel_logits_to_logprobs
    x, ids = torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long)
    assert call(x, ids, 3, 6, tp_group="tp", cp_group="cp", chunk_size=None, sampling_params=None) == (
        3,
        6,
        "tp",
        False,
        "cp",
    )
    with pytest.raises(TypeError, match="chunk_size"):
        call(x, ids, 3, 6, tp_group="tp", chunk_size=4)

    # a parameter the signature calls renamed but whose default differs is another parameter (NeMo-RL baa4caa's
    # shift_and_slice=True where the seed has cp_group=None): the seed's default is left out, not passed to it
    def older(
        vocab_parallel_logits, target, vocab_start_index, vocab_end_index, group, inference_only=False, shift=True
    ):
        return (group, shift)

    module = type("M", (), {"from_parallel_logits_to_logprobs": staticmethod(older)})
    call = KeywordCalls(module, seed_mod).from_parallel_logits_to_logprobs
    assert call(x, ids, 3, 6, tp_group="tp", cp_group=None) == ("tp", True)
