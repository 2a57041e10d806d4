"""`shardcheck run --model-config DIR` (harness/driver/model_config.py, suites/_model_config.py): a user's
Transformers model directory checked at a small size under Transformers' own TP plan; its rerun line names the
directory again; a path that does not exist, a config Transformers cannot load, a model type without a TP plan:
one line, exit 2, nothing run."""

from __future__ import annotations

import importlib.util
import json
import shlex

import pytest
from helpers import cli

from shardcheck.harness.core.options import EXIT_USAGE, RunSettings
from shardcheck.harness.core.plan_data import MODEL_CONFIG_SUITE, Item, Plan
from shardcheck.harness.driver.collect import rerun_command

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is not installed (pip install -e .[hf])"
)
TP2 = ("--topology", "dp=1,cp=1,tp=2", "--dtype", "float64")


@pytest.fixture
def llama_dir(tmp_path):
    """A user's Llama: 3 layers, 8 query / 4 key-value heads, hidden 512, vocab 1000 (as save_pretrained writes)."""
    import transformers

    cfg = transformers.LlamaConfig(
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=4,
        hidden_size=512,
        intermediate_size=1024,
        vocab_size=1000,
    )
    cfg.save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


def test_shrink_keeps_the_head_counts_and_cuts_layers_widths_and_vocabulary(llama_dir):
    from shardcheck.suites import _model_config

    cfg = _model_config.shrink(_model_config.load(str(llama_dir)))
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (8, 4)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim, cfg.intermediate_size) == (2, 32, 4, 64)
    assert cfg.vocab_size == 64 and cfg.model_type == "llama"


def test_a_users_moe_keeps_its_experts_and_gets_an_expert_parallel_case_too(tmp_path):
    import transformers

    from shardcheck.suites import _model_config

    transformers.Qwen3MoeConfig(
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        hidden_size=256,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        intermediate_size=512,
    ).save_pretrained(tmp_path / "moe")
    cfg = _model_config.shrink(_model_config.load(str(tmp_path / "moe")))
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.hidden_size) == (8, 2, 64, 32)
    cases = _model_config.cases(str(tmp_path / "moe"))
    assert [c.case_id for c in cases] == ["qwen3_moe-tp", "qwen3_moe-ep"]
    assert cases[1].unchecked_modules == (_model_config.EXPERT_ACT,)


def test_a_users_llama_passes_at_tp_2_and_its_rerun_line_names_the_directory(run_shardcheck, llama_dir):
    run = run_shardcheck("run", "--model-config", str(llama_dir), *TP2)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    rows = run.rows
    assert (rows["status"] == "pass").all() and set(rows["suite"]) == {MODEL_CONFIG_SUITE}
    assert set(rows["case_id"]) == {"llama-tp"} and set(rows["tp"]) == {2}
    checks = set(rows["check"])
    assert "forward:dparam:model.layers.1.mlp.down_proj.weight" in checks
    assert not any("model.layers.2." in c for c in checks)  # two of the user's three layers
    assert any(c.endswith(":model.layers.0.self_attn.q_proj") and ":act" in c for c in checks)

    row = rows.iloc[0]
    meta = json.loads((run.out / "run.json").read_text())
    assert meta["options"]["model_config"] == str(llama_dir.resolve())
    plan = Plan(
        run_id="r",
        quick=False,
        settings=RunSettings(device="cpu", backend="gloo"),
        impl=meta["impl"],  # the generated suite holds its own module under test
        suite_paths=meta["options"]["suite_paths"],
        model_config=meta["options"]["model_config"],
    )
    item = Item(
        id=0,
        suite=row["suite"],
        op=row["op"],
        case_id=row["case_id"],
        dtype="float64",
        topology=(1, 1, 2),
        world_size=2,
        seed=0,
        checks=["forward"],
    )
    args = shlex.split(rerun_command(plan, item))
    assert args[args.index("--model-config") + 1] == str(llama_dir.resolve())
    assert "--suite-path" not in args and "--impl" not in args  # nothing of this run's folder
    again = run_shardcheck(*args[1:])
    assert again.returncode == 0, again.stdout[-3000:]
    assert sorted(again.rows["check"]) == sorted(rows["check"])


def _one_line_exit_2(*args: str) -> str:
    proc = cli("run", *args, *TP2, "--no-progress")
    assert proc.returncode == EXIT_USAGE, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr and not proc.stdout.strip(), proc.stderr
    return lines[0]


def test_a_path_that_does_not_exist_is_one_line_and_exit_2(tmp_path):
    line = _one_line_exit_2("--model-config", str(tmp_path / "nowhere"), "--out", str(tmp_path / "run"))
    assert "nowhere" in line and "no config.json" in line
    assert not (tmp_path / "run").exists()


def test_a_config_transformers_cannot_load_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps({"model_type": "no_such_model"}))
    line = _one_line_exit_2("--model-config", str(tmp_path / "bad"), "--out", str(tmp_path / "run"))
    assert "Transformers cannot load it" in line and "no_such_model" in line


def test_a_model_type_without_a_tp_plan_is_one_line_and_exit_2(tmp_path):
    import transformers

    transformers.GPT2Config(n_layer=2).save_pretrained(tmp_path / "gpt2")
    line = _one_line_exit_2("--model-config", str(tmp_path / "gpt2"), "--out", str(tmp_path / "run"))
    assert "'gpt2' has no tensor-parallel plan" in line
    assert not (tmp_path / "run").exists()


def test_a_model_type_with_a_tp_plan_but_no_causal_lm_class_is_one_line_and_exit_2(tmp_path):
    import transformers

    transformers.AutoConfig.for_model("eurobert").save_pretrained(tmp_path / "encoder")
    line = _one_line_exit_2("--model-config", str(tmp_path / "encoder"), "--out", str(tmp_path / "run"))
    assert "'eurobert' has no causal-LM class" in line
