"""examples/: the suites of two ops that are not ours, Megatron-Core's `vocab_parallel_cross_entropy` and torch's
`loss_parallel` cross-entropy.  Their references against torch's own functions; one run of both suites as CI runs
them (world sizes 1 and 2: TP 1 and 2, DP 2; `--quick`), with what they find recorded `xfail` and everything else
passing; a broken variant of each caught on the right check.  The full TP 1, 2, 4 matrix is the README's command.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from helpers import BROKEN, ROOT, shardcheck

from shardcheck.harness.rank.suite_loader import load_suite

EXAMPLES = ROOT / "examples"
MEGATRON = EXAMPLES / "megatron_vocab_parallel_ce"
TORCH_LP = EXAMPLES / "torch_loss_parallel"
CI_RUN = ("run", "--suite-path", str(MEGATRON), "--suite-path", str(TORCH_LP), "--world-sizes", "1,2", "--quick")


megatron_suite = load_suite("megatron_vocab_parallel_ce", [str(MEGATRON)])  # as shardcheck imports them
torch_suite = load_suite("torch_loss_parallel", [str(TORCH_LP)])
NO_MEGATRON = megatron_suite.megatron_missing()


def _logits(*shape, seed=0, scale=3.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def _targets(shape, v, seed=1):
    return torch.randint(0, v, shape, generator=torch.Generator().manual_seed(seed))


# ---- the references -----------------------------------------------------------------------------------------------


def test_megatron_reference_is_cross_entropy_with_megatrons_smoothing():
    logits, target = _logits(5, 3, 11), _targets((5, 3), 11)
    torch.testing.assert_close(
        megatron_suite.cross_entropy(logits, target),
        F.cross_entropy(logits.transpose(1, 2), target, reduction="none"),
        rtol=1e-12,
        atol=1e-12,
    )
    # smoothing α: the target keeps 1 − α, the other V − 1 entries share α (not torch's α/V over all V)
    alpha = 0.3
    q = torch.full(logits.shape, alpha / 10, dtype=torch.float64).scatter_(-1, target.unsqueeze(-1), 1 - alpha)
    expected = -(q * logits.log_softmax(-1)).sum(-1)
    torch.testing.assert_close(megatron_suite.cross_entropy(logits, target, alpha), expected, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(
        expected, F.cross_entropy(logits.transpose(1, 2), target, reduction="none", label_smoothing=alpha)
    )
    # float32 whatever the input; an id outside [0, V) has no answer
    assert megatron_suite.cross_entropy(logits.bfloat16(), target).dtype == torch.float32
    target[0, 0], target[1, 1] = -100, 11
    got = megatron_suite.cross_entropy(logits, target)
    assert got[0, 0].isnan() and got[1, 1].isnan() and got.isnan().sum() == 2


TORCH_REFERENCE_CASES = {
    "mean": ((6, 13), {}),
    "sum-weight-ignored": ((6, 13), dict(reduction="sum", weight=True, ignored=True)),
    "mean-weight-ignored": ((6, 13), dict(weight=True, ignored=True)),
    "none-ignore3": ((6, 13), dict(reduction="none", ignore_index=3, ignored=True)),
    "mean-smoothing-weight-ignored": ((6, 13), dict(label_smoothing=0.2, weight=True, ignored=True)),
    "bvs-none": ((2, 13, 4), dict(reduction="none")),
    "bvhw-mean-ignored": ((2, 13, 3, 2), dict(ignored=True)),
    "one-sample": ((13,), {}),
    "probs-mean": ((6, 13), dict(probs=True)),
    "probs-smoothing-sum": ((6, 13), dict(probs=True, label_smoothing=0.1, reduction="sum")),
}


@pytest.mark.parametrize("name", sorted(TORCH_REFERENCE_CASES))
def test_torch_reference_is_f_cross_entropy_values_and_gradients(name):
    shape, opts = TORCH_REFERENCE_CASES[name]
    opts = dict(opts)
    logits = _logits(*shape)
    dim = 1 if len(shape) > 1 else 0
    if opts.pop("probs", False):
        target = _logits(*shape, seed=2).softmax(dim)
    else:
        target = _targets(tuple(s for i, s in enumerate(shape) if i != dim), shape[dim])
        if opts.pop("ignored", False):
            target.view(-1)[::3] = opts.get("ignore_index", -100)
    if opts.pop("weight", False):
        opts["weight"] = torch.rand(shape[dim], generator=torch.Generator().manual_seed(3), dtype=torch.float64) + 0.5
    ours, theirs = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    got, expected = torch_suite.cross_entropy(ours, target, **opts), F.cross_entropy(theirs, target, **opts)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    upstream = _logits(*got.shape, seed=4) if got.ndim else torch.tensor(0.7, dtype=torch.float64)
    got.backward(upstream)
    expected.backward(upstream)
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-12, atol=1e-12)


# ---- both suites as CI runs them ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ci_run(tmp_path_factory):
    # not --strict: Megatron computes float64 logits in float32, a `warn` by the harness's rules (asserted below)
    return shardcheck(*CI_RUN, out=tmp_path_factory.mktemp("examples") / "run", strict=False)


def _xfail_rows(rows, suite) -> Counter:
    xfail = rows[(rows["suite"] == suite) & (rows["status"] == "xfail")]
    return Counter(zip(xfail["case_id"], xfail["check"]))


def test_the_examples_run_clean_but_for_what_they_found(ci_run):
    assert ci_run.returncode == 0, ci_run.stdout[-3000:] + ci_run.stderr[-2000:]
    rows = ci_run.rows
    assert set(rows["suite"]) == {"megatron_vocab_parallel_ce", "torch_loss_parallel"}
    assert {(d, c, t) for d, c, t in zip(rows["dp"], rows["cp"], rows["tp"])} == {(1, 1, 1), (2, 1, 1), (1, 1, 2)}
    assert not rows["status"].isin(["fail", "error", "xpass"]).any()
    assert "Known failures (" in ci_run.stdout


def test_torch_loss_parallel_example_at_tp_1_and_2(ci_run):
    rows = ci_run.rows[ci_run.rows["suite"] == "torch_loss_parallel"]
    assert Counter(rows["status"]) == {"pass": 409, "xfail": 33}
    assert _xfail_rows(rows, "torch_loss_parallel") == {
        ("n8v37-none-masked0.3-weight", "grad:logits"): 9,  # the backward raises on weight + ignored targets
        ("bvhw-n8s3v37-none", "grad:logits"): 9,  # 4-D input: the one-hot at the H/W-swapped position
        ("n8v37", "grad:logits"): 9,  # log_softmax: the identity backward
        ("n8v37-mean-probs", "grad:logits"): 4,  # class probabilities: the same identity backward
        ("n8v37-mean-ids-out-of-range", "property:bad_input"): 2,  # ids outside [0, V): loss 0, silently
    }
    identity = rows[(rows["op"] == "torch_loss_parallel.log_softmax") & (rows["status"] == "xfail")]
    assert set(identity["xfail_reference"]) == {"https://github.com/pytorch/pytorch/issues/190746"}
    # the weighted backward raises on every rank, named by its exception
    raised = rows[(rows["case_id"] == "n8v37-none-masked0.3-weight") & (rows["status"] == "xfail")]
    assert raised["message"].str.contains("index -100 is out of bounds").all()
    # the loud refusals pass: label smoothing, mean on a 2-D mesh, a backward outside the context
    refused = rows[rows["check"] == "property:bad_input"].groupby("case_id")["message"].first()
    assert "NotImplementedError" in refused["n8v37-mean-mesh-dp-tp"]
    assert refused["n8v37-mean-backward-outside"].startswith("in backward: raised RuntimeError")
    assert refused["n8v37-mean-ls0.1"].startswith("raised RuntimeError")
    # the communication contract holds exactly: 3 all-reduces of per-token scalars forward, nothing backward
    comm = rows[(rows["check"] == "property:comm") & (rows["case_id"] == "n8v37-mean") & (rows["tp"] == 2)]
    assert list(comm["status"]) == ["pass"] * 3 and all(
        c == {"forward": {"all_reduce@tp": 3}} for c in comm["comm_calls"]
    )


@pytest.mark.skipif(NO_MEGATRON is not None, reason=f"{NO_MEGATRON}: the Megatron example's cases are all skipped")
def test_megatron_example_at_tp_1_and_2(ci_run):
    rows = ci_run.rows[ci_run.rows["suite"] == "megatron_vocab_parallel_ce"]
    assert Counter(rows["status"]) == {"pass": 252, "warn": 44, "xfail": 34}
    # every warning: float64 logits computed in float32, on values and gradients
    warned = rows[rows["status"] == "warn"]
    assert set(warned["dtype"]) == {"float64"} and set(warned["check"]) == {"forward", "grad:logits"}
    assert warned["message"].str.contains("): float64 computed in float32 (err/budget", regex=False).all()
    assert _xfail_rows(rows, "megatron_vocab_parallel_ce") == {
        ("s6b4v64-ls0.1", "forward"): 2,
        ("s6b4v64-ls0.1", "grad:logits"): 2,  # smoothing over each rank's piece
        ("s6b4v64-ls0.1", "property:tp_ranks_agree"): 2,
        ("s6b4v64-scale100-ls0.1", "forward"): 9,  # log(0) after the softmax underflows: +inf, at every TP
        # at TP 2 the gradients are off; at TP 1 (float64) only float32 math shows, within that budget: the mark
        # covers grad:* at every TP, and a marked check is xfail whatever budget its error fits
        ("s6b4v64-scale100-ls0.1", "grad:logits"): 4,
        ("caller-logits", "property:logits_unchanged"): 3,  # float32 logits overwritten in place
        ("s6b4v64-ids-out-of-range", "property:bad_input"): 3,  # no ignore_index, no refusal
        ("s6b4v37-uneven-vocab", "forward"): 3,
        ("s6b4v37-uneven-vocab", "grad:logits"): 3,  # unequal pieces
        ("s6b4v64-ls-0.1", "property:bad_input"): 3,  # a negative label_smoothing ignored
    }
    smoothing = rows[(rows["case_id"] == "s6b4v64-ls0.1") & (rows["status"] == "xfail")]
    assert set(smoothing["tp"]) == {2} and set(smoothing["xfail_reference"]) == {
        "https://github.com/NVIDIA/Megatron-LM/issues/737"
    }
    overwritten = rows[(rows["check"] == "property:logits_unchanged") & (rows["status"] == "xfail")]
    assert set(overwritten["dtype"]) == {"float32"}
    assert (
        overwritten["message"]
        .str.contains("overwritten in place (they now hold the logits' gradient)", regex=False)
        .all()
    )
    # Megatron's own masking (loss · loss_mask, ids -100 under the mask) is right, values and gradients
    masked = rows[rows["case_id"] == "s6b4v64-loss-mask"]
    assert set(masked[masked["dtype"] != "float64"]["status"]) == {"pass"}


# ---- a broken variant of each is caught ---------------------------------------------------------------------------


@pytest.mark.skipif(NO_MEGATRON is not None, reason=f"{NO_MEGATRON}")
def test_megatron_example_catches_local_target_ids(run_shardcheck):
    run = run_shardcheck(
        "run",
        "--suite-path",
        str(MEGATRON),
        "--impl",
        f"megatron_vocab_parallel_ce={BROKEN / 'megatron_vocab_parallel_ce' / 'local_target_ids.py'}",
        "--case",
        "s6b4v64",
        "--case",
        "n24v40",
        "--world-sizes",
        "1,2",
        "--dtype",
        "float32",
    )
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-2000:]
    failed = run.failed()
    assert set(failed["tp"]) == {2} and set(failed["check"]) == {"forward", "grad:logits"}
    assert set(failed["status"]) == {"fail"}
    assert "rerun: shardcheck run --suite-path" in run.stdout


def test_torch_example_catches_a_loss_that_gathers_the_vocab(run_shardcheck):
    run = run_shardcheck(
        "run",
        "--suite-path",
        str(TORCH_LP),
        "--impl",
        f"torch_loss_parallel={BROKEN / 'torch_loss_parallel' / 'gathers_the_vocab.py'}",
        "--case",
        "n8v37-mean",
        "--case",
        "n8v37-none-masked0.3",
        "--world-sizes",
        "1,2",
        "--dtype",
        "float32",
    )
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-2000:]  # --strict: a comm finding fails the run
    failed = run.failed()
    assert set(failed["check"]) == {"property:comm"} and set(failed["tp"]) == {2}
    assert failed["message"].str.contains("forward all_gather@tp").all()
    values = run.rows[run.rows["check"].isin(["forward", "grad:logits"])]
    assert set(values["status"]) == {"pass"}  # right values: only the contract tells
