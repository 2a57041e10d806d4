"""Linear-CE fusion for Megatron-Core's GPTModel (suite model_utils_megatron): the real implementation passes at
TP 1, 2 and 4 (values, every parameter's gradient on every rank, flag-off bit-identity, bad use -> ValueError),
broken ones are caught, and without megatron-core the cases are recorded `skip` with the reason."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from helpers import BROKEN, IMPLS, ROOT

PATCH = "model_utils.patch_gpt_model_forward_for_linear_ce_fusion"
FLAG_OFF = "model_utils._gpt_forward_with_linear_ce_fusion"
SUITE = ("--suite", "model_utils_megatron", "--dtype", "float64", "--timeout", "120")
needs_megatron = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed (pip install -e .[megatron])"
)


@needs_megatron
def test_fusion_passes_at_tp_1_2_4(run_shardcheck):
    run = run_shardcheck(
        "run", *SUITE, "--quick", *(a for tp in (1, 2, 4) for a in ("--topology", f"dp=1,cp=1,tp={tp}"))
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = run.rows
    assert (rows["status"] == "pass").all()
    for tp in (1, 2, 4):
        fused = rows[(rows["op"] == PATCH) & (rows["tp"] == tp) & ~rows["case_id"].str.startswith("error-")]
        assert set(fused["case_id"]) == {"tied-chunk5", "untied-chunk5"}
        checks = set(fused[fused["case_id"] == "untied-chunk5"]["check"])
        # the values, every parameter's gradient (28 in the untied model) and the no-grad / double-patch property
        assert {
            "forward",
            "property:no_grad_same",
            "grad:embedding.word_embeddings.weight",
            "grad:output_layer.weight",
            "grad:decoder.final_layernorm.bias",
            "grad:decoder.layers.1.self_attention.linear_qkv.weight",
        } <= checks
        assert len([c for c in checks if c.startswith("grad:")]) == 28
        assert all(len(r) == tp for r in fused["per_rank"])  # every rank checked
        assert (fused["err_ratio"].dropna() < 1e-2).all()  # float64: far inside the budget
        flag_off = rows[(rows["op"] == FLAG_OFF) & (rows["tp"] == tp)]
        assert {"forward", "property:bit_identical_logits", "property:bit_identical_loss"} <= set(flag_off["check"])
        model = rows[(rows["case_id"] == "model-untied") & (rows["tp"] == tp)]  # its gradients: the model case's
        assert {"forward:dparam:decoder.final_layernorm.weight", "forward:step:output_layer.weight"} <= set(
            model["check"]
        )
        errors = set(rows[(rows["tp"] == tp) & rows["case_id"].str.startswith("error-")]["case_id"])
        assert {"error-no-labels", "error-loss-mask", "error-chunk-size-0"} <= errors
        assert ("error-tp-without-sequence-parallel" in errors) == (tp > 1)


def _broken(run_shardcheck, module: str, tp: int):
    run = run_shardcheck(
        "run",
        *SUITE,
        "--impl",
        f"model_utils={BROKEN / 'model_utils_megatron' / module}.py",
        "--op",
        PATCH,
        "--case",
        "untied-chunk5",
        "--topology",
        f"dp=1,cp=1,tp={tp}",
    )
    assert run.returncode == 1, run.stdout + run.stderr
    return run.rows.set_index("check")


@needs_megatron
def test_labels_not_rolled_is_caught(run_shardcheck):
    rows = _broken(run_shardcheck, "labels_not_rolled", tp=1)  # wrong at any TP size: the cheapest launch
    forward = rows.loc["forward"]
    assert forward["status"] == "fail" and forward["err_ratio"] > 100
    assert rows.loc["grad:output_layer.weight", "status"] == "fail"
    assert forward["mismatch"]["global_index"] is not None


@needs_megatron
def test_hidden_grad_not_reduce_scattered_is_caught(run_shardcheck):
    rows = _broken(run_shardcheck, "hidden_grad_not_reduce_scattered", tp=2)
    # values and the (local) output-weight gradient are right; everything below the hidden states is wrong
    assert rows.loc["forward", "status"] == "pass"
    assert rows.loc["grad:output_layer.weight", "status"] == "pass"
    for check in (
        "grad:decoder.final_layernorm.weight",
        "grad:decoder.layers.0.mlp.linear_fc1.weight",
        "grad:embedding.word_embeddings.weight",
    ):
        row = rows.loc[check]
        assert row["status"] == "fail" and row["err_ratio"] > 100, check
        assert {r["rank"] for r in row["per_rank"] if r["status"] == "fail"} == {0, 1}


@needs_megatron
def test_two_cases_in_a_row_on_an_implementation_with_its_own_patched_flag(run_shardcheck):
    """The patch keeps an "already patched" flag in its module: each case undoes it with GPTModel.forward, so the second
    case (and the second patch within each case) patches again instead of finding the flag set on the original."""
    run = run_shardcheck(
        "run",
        *SUITE,
        "--impl",
        f"model_utils={IMPLS / 'patch_flag_model_utils.py'}",
        "--op",
        PATCH,
        "--case",
        "tied-chunk5",
        "--case",
        "untied-chunk5",
        "--topology",
        "dp=1,cp=1,tp=1",
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = run.rows
    assert set(rows["case_id"]) == {"tied-chunk5", "untied-chunk5"} and (rows["status"] == "pass").all()
    assert "property:no_grad_same" in set(rows["check"])  # patched twice more inside each case, after the first


def test_restored_undoes_a_class_patch_and_the_patchers_markers():
    from shardcheck.harness.core.restore import owners_of, restored

    class Foreign:
        def forward(self):
            return "own"

    state = {"patched": False}
    exec("def patch():\n    global PATCHED\n    PATCHED = True\n", state)
    original = Foreign.forward
    with restored(Foreign, *owners_of(state["patch"])):
        state["patch"]()
        state["patch"].marker = 1
        Foreign.forward = lambda self: "patched"
        Foreign._was_patched = True
        assert Foreign().forward() == "patched" and state["PATCHED"]
    assert Foreign.forward is original and not hasattr(Foreign, "_was_patched")
    assert "PATCHED" not in state and not hasattr(state["patch"], "marker") and state["patched"] is False


def test_without_megatron_the_cases_are_skipped_with_the_reason(run_shardcheck, tmp_path, monkeypatch):
    shadow = tmp_path / "shadow" / "megatron"  # an empty `megatron` package first on the path: no megatron.core
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", f"{shadow.parent}:{ROOT}")
    run = run_shardcheck(
        "run", *SUITE, "--quick", "--topology", "dp=1,cp=1,tp=1", timeout=300, fresh=True
    )  # a process of its own: the PYTHONPATH above
    assert run.returncode == 0, run.stdout + run.stderr
    rows = run.rows
    assert len(rows) and (rows["status"] == "skip").all()
    assert "model-untied" in set(rows["case_id"])  # the model case too, never built
    assert rows["message"].str.contains(r"megatron-core is not installed \(pip install -e .\[megatron\]\)").all()
    assert " skipped" in run.stdout


def test_model_utils_imports_without_megatron():
    code = (
        "import sys, shardcheck.distributed_impl.model_utils as m; m.patch_gpt_model_forward_for_linear_ce_fusion; "
        "assert not any(n.startswith('megatron') for n in sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)
