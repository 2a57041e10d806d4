"""`shardcheck run --model-config "--module M --config FN ..."` (suites/_titan_config.py,
harness/driver/model_config.py): a user's torchtitan job, loaded by torchtitan's own ConfigManager, checked at a
small size: its model (heads, RoPE, experts, top-k kept), its parallel degrees scaled onto at most 4 CPU ranks, each
reduction said; a job torchtitan cannot load, a model the titan suite does not build: one line, exit 2, nothing run."""

from __future__ import annotations

import importlib.util
import json
import shlex
from types import SimpleNamespace

import pytest
from helpers import cli

from shardcheck.harness.core.options import EXIT_USAGE, RunSettings
from shardcheck.harness.core.plan_data import MODEL_CONFIG_SUITE, Item, Plan
from shardcheck.harness.driver.collect import rerun_command

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None, reason="torchtitan is not installed (pip install -e .[titan])"
)
LLAMA_8B = "--module llama3 --config llama3_8b"
DEBUG_TP2 = (
    "--module llama3 --config llama3_debugmodel "
    "--parallelism.tensor_parallel_degree 2 --parallelism.data_parallel_shard_degree 1"
)


@pytest.fixture(scope="module")
def titan_config():
    """suites/_titan_config.py, with the import-only Triton stub torchtitan's config registries need (as the CLI)."""
    from shardcheck.harness.rank.shims import triton_import

    if triton_import.wanted():
        triton_import.install()
    from shardcheck.suites import _titan_config

    return _titan_config


def parallelism(**degrees):
    """A ParallelismConfig's fields as `scale` reads them (torchtitan's defaults: dp_shard -1, spmd_types)."""
    fields = {
        "tensor_parallel_degree": 1,
        "data_parallel_shard_degree": -1,
        "data_parallel_replicate_degree": 1,
        "context_parallel_degree": 1,
        "pipeline_parallel_degree": 1,
        "expert_parallel_degree": 1,
        "enable_sequence_parallel": True,
        "spmd_backend": "spmd_types",
    }
    return SimpleNamespace(**{**fields, **degrees})


def test_a_jobs_degrees_scale_onto_four_ranks_and_each_reduction_is_said(titan_config):
    from shardcheck.suites import _titan_models as titan

    dense = titan.Arch(heads=32, kv_heads=8)
    m = titan_config.scale(parallelism(tensor_parallel_degree=8, pipeline_parallel_degree=2), "llama3", dense)
    assert (m.degrees.tp, m.degrees.dp_shard, m.degrees.dp_replicate, m.topology) == (2, 2, 1, "dp=2,cp=1,tp=2")
    assert m.notes == (
        "tensor_parallel_degree 8 -> 2",
        "data_parallel_shard_degree -1 (the rest of the world) -> 2",
        "pipeline_parallel_degree 2 -> 1 (not run: the titan suite has no PP)",
        "spmd_backend spmd_types -> partial_dtensor (the backend the titan suite checks)",
    )
    alone = titan_config.scale(parallelism(spmd_backend="partial_dtensor"), "llama3", dense)  # FSDP over the rest
    assert (alone.topology, alone.notes) == (
        "dp=4,cp=1,tp=1",
        ("data_parallel_shard_degree -1 (the rest of the world) -> 4",),
    )
    hsdp = titan_config.scale(
        parallelism(data_parallel_replicate_degree=2, data_parallel_shard_degree=8, tensor_parallel_degree=4),
        "llama3",
        dense,
    )
    assert hsdp.topology == "dp=2,cp=1,tp=2"  # tp and dp_shard keep their ranks, the third dim does not fit
    assert (
        "data_parallel_replicate_degree 2 (world size 4 at most: two of tp, cp, dp_shard, dp_replicate fit) -> 1"
        in hsdp.notes
    )
    odd = titan_config.scale(parallelism(tensor_parallel_degree=3, data_parallel_shard_degree=1), "llama3", dense)
    assert odd.degrees.tp == 1 and "tensor_parallel_degree 3 -> 1" in odd.notes  # no power of two within 4 divides 3
    replicate = titan_config.scale(
        parallelism(data_parallel_replicate_degree=2, data_parallel_shard_degree=1), "llama3", dense
    )
    assert replicate.topology == "dp=2,cp=1,tp=1,dp_replicate=2"


def test_a_jobs_context_parallel_degree_maps_onto_cp_before_dp_shard(titan_config):
    """CP keeps its ranks before dp_shard (a job's dp_shard is mostly -1, the rest of the world); the case is the titan
    suite's CP case at that topology."""
    from shardcheck.suites import _titan_models as titan

    dense = titan.Arch(heads=32, kv_heads=8)
    m = titan_config.scale(parallelism(tensor_parallel_degree=8, context_parallel_degree=2), "llama3", dense)
    assert (m.degrees.tp, m.degrees.cp, m.degrees.dp_shard, m.topology) == (2, 2, 1, "dp=1,cp=2,tp=2")
    assert m.notes[:2] == (
        "tensor_parallel_degree 8 -> 2",
        "data_parallel_shard_degree -1 (the rest of the world) (world size 4 at most: two of tp, cp, dp_shard, "
        "dp_replicate fit) -> 1",
    )
    alone = titan_config.scale(parallelism(context_parallel_degree=8, data_parallel_shard_degree=1), "llama3", dense)
    assert alone.topology == "dp=1,cp=4,tp=1" and "context_parallel_degree 8 -> 4" in alone.notes
    with_dp = titan_config.scale(parallelism(context_parallel_degree=2), "llama3", dense)
    assert with_dp.topology == "dp=2,cp=2,tp=1"
    moe = titan.Arch(heads=32, kv_heads=4, experts=128, top_k=8)
    ep = titan_config.scale(parallelism(context_parallel_degree=2, expert_parallel_degree=8), "qwen3_moe", moe)
    assert ep.expert_parallel and (ep.degrees.ep, ep.degrees.dp_shard, ep.degrees.cp) == (4, 2, 2)
    (case,) = titan_config.cases(f"{LLAMA_8B} --parallelism.context_parallel_degree 2")
    assert (case.case_id, case.params["degrees"], case.params["context_parallel"]) == (
        "llama3-cp-tp-sp",
        "dp=2,cp=2,tp=1",
        True,
    )


def test_expert_parallelism_goes_over_the_dp_shard_and_tp_ranks(titan_config):
    from shardcheck.suites import _titan_models as titan

    moe = titan.Arch(heads=32, kv_heads=4, experts=128, top_k=8)
    m = titan_config.scale(parallelism(expert_parallel_degree=8, tensor_parallel_degree=2), "qwen3_moe", moe)
    assert m.expert_parallel and (m.degrees.ep, m.degrees.dp_shard, m.degrees.tp) == (4, 2, 2)
    assert "expert_parallel_degree 8 -> 4 (EP over the dp_shard x cp x tp ranks, efsdp 1)" in m.notes
    tp_experts = titan_config.scale(parallelism(tensor_parallel_degree=2), "qwen3_moe", moe)
    assert not tp_experts.expert_parallel and tp_experts.degrees.ep == 1
    dense = titan_config.scale(parallelism(expert_parallel_degree=2), "llama3", titan.Arch())
    assert not dense.expert_parallel and "expert_parallel_degree 2 -> 1 (the model has no experts)" in dense.notes


def test_a_job_loads_through_torchtitans_config_manager_with_its_models_heads_and_experts(titan_config):
    model, arch, m = titan_config.plan(f"{LLAMA_8B} --parallelism.tensor_parallel_degree 8")
    assert (model, arch.heads, arch.kv_heads, arch.rope.theta, arch.rope.scaling) == ("llama3", 32, 8, 500000, "llama")
    assert m.topology == "dp=2,cp=1,tp=2"
    model, arch, m = titan_config.plan(
        "--module qwen3 --config qwen3_moe_debug --parallelism.expert_parallel_degree 2 --training.disable_cuda_graphs"
    )
    assert (model, arch.experts, arch.top_k) == ("qwen3_moe", 64, 8) and m.expert_parallel
    (case,) = titan_config.cases(
        f"{LLAMA_8B} --parallelism.tensor_parallel_degree 2 --parallelism.data_parallel_shard_degree 1"
    )
    assert (case.case_id, case.op, case.params["degrees"]) == (
        "llama3-tp-sp",
        "model_config.parallelize",
        "dp=1,cp=1,tp=2",
    )


def _one_line_exit_2(spec: str, tmp_path) -> str:
    proc = cli("run", "--model-config", spec, "--no-progress", "--out", str(tmp_path / "run"))
    assert proc.returncode == EXIT_USAGE, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr and not proc.stdout.strip(), proc.stderr
    assert not (tmp_path / "run").exists()
    return lines[0]


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        ("--module no_such_model --config x", "torchtitan cannot load it: Cannot import module 'no_such_model'"),
        ("--module llama3 --config no_such_fn", "Config function 'no_such_fn' not found"),
        (f"{LLAMA_8B} --parallelism.no_such_degree 2", "Unrecognized options: --parallelism.no_such_degree"),
        (f"{LLAMA_8B} --parallelism.tensor_parallel_degree two", "invalid literal for int()"),
        (
            "--module deepseek_v3 --config deepseek_v3_16b",
            "'deepseek_v3' (flavor '16B') is not one the titan suite builds",
        ),
    ],
)
def test_a_job_torchtitan_cannot_load_or_the_suite_cannot_build_is_one_line_and_exit_2(tmp_path, spec, said):
    line = _one_line_exit_2(spec, tmp_path)
    assert said in line and repr(spec) in line, line


def test_a_users_llama_job_passes_at_its_tp_and_its_rerun_line_names_the_job(run_shardcheck):
    run = run_shardcheck("run", "--model-config", DEBUG_TP2, "--dtype", "float32")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    rows = run.rows
    assert (rows["status"] == "pass").all() and set(rows["suite"]) == {MODEL_CONFIG_SUITE}
    assert set(rows["case_id"]) == {"llama3-tp-sp"} and set(rows["tp"]) == {2} and set(rows["dp"]) == {1}
    checks = set(rows["check"])
    assert any("layers.1.feed_forward.w2" in c for c in checks)
    assert not any("layers.2." in c for c in checks)  # two of the debug model's six layers
    assert "shardcheck: torchtitan job: llama3 at dp=1,cp=1,tp=2 (spmd_backend spmd_types -> partial_dtensor" in (
        run.stderr
    )
    meta = json.loads((run.out / "run.json").read_text())
    assert meta["options"]["model_config"] == DEBUG_TP2
    plan = Plan(
        run_id="r",
        quick=False,
        settings=RunSettings(device="cpu", backend="gloo"),
        impl=meta["impl"],
        suite_paths=meta["options"]["suite_paths"],
        model_config=meta["options"]["model_config"],
    )
    row = rows.iloc[0]
    item = Item(
        id=0,
        suite=row["suite"],
        op=row["op"],
        case_id=row["case_id"],
        dtype="float32",
        topology=(1, 1, 2),
        world_size=2,
        seed=0,
        checks=["forward"],
    )
    args = shlex.split(rerun_command(plan, item))
    assert args[args.index("--model-config") + 1] == DEBUG_TP2  # the job again, not this run's generated suite
    assert "--suite-path" not in args and args[args.index("--topology") + 1] == "dp=1,cp=1,tp=2"


def test_a_job_selects_its_own_topology_and_says_what_it_reduced(titan_config, tmp_path, capsys):
    import argparse

    from shardcheck.harness.driver.model_config import add_model_config_suite

    spec = f"{LLAMA_8B} --parallelism.tensor_parallel_degree 8"
    args = argparse.Namespace(model_config=spec, topology=None, suite_path=None, suite=None)
    add_model_config_suite(args, tmp_path)
    assert args.topology == ["dp=2,cp=1,tp=2"] and args.model_config == spec
    (suite,) = args.suite_path
    assert f"CONFIG = {spec!r}" in open(suite).read()
    said = capsys.readouterr().err.strip().splitlines()
    assert said == [
        "shardcheck: torchtitan job: llama3 at dp=2,cp=1,tp=2 (tensor_parallel_degree 8 -> 2; "
        "data_parallel_shard_degree -1 (the rest of the world) -> 2; "
        "spmd_backend spmd_types -> partial_dtensor (the backend the titan suite checks))"
    ]
    given = argparse.Namespace(model_config=spec, topology=["dp=1,cp=1,tp=2"], suite_path=None, suite=["titan"])
    add_model_config_suite(given, tmp_path)
    assert given.topology == ["dp=1,cp=1,tp=2"] and given.suite == ["titan", MODEL_CONFIG_SUITE]  # the run's own


def test_a_users_moe_job_under_fsdp_passes_with_the_experts_rows_unchecked(run_shardcheck, titan_config):
    """qwen3_moe_debug (64 experts, top 8; routers without a margin: float32) under FSDP 2, experts not
    expert-parallel: each rank's experts see its own batch's tokens, which no layout maps (unchecked), and every
    other activation, gradient and parameter is compared."""
    from shardcheck.suites import titan

    spec = (
        "--module qwen3 --config qwen3_moe_debug "
        "--parallelism.data_parallel_shard_degree 2 --training.disable_cuda_graphs"
    )
    (case,) = titan_config.cases(spec)
    assert case.case_id == "qwen3_moe-fsdp-tp-sp" and case.unchecked_modules == (titan.EXPERTS,)
    assert case.dtypes == ("float32",)
    run = run_shardcheck("run", "--model-config", spec)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    rows = run.rows
    assert (rows["status"] == "pass").all() and set(rows["dp"]) == {2} and set(rows["dtype"]) == {"float32"}
    checks = set(rows["check"])
    assert any("layers.1.moe.routed_experts" in c and ":act" in c for c in checks)  # the experts' output compared
    assert any(c.endswith("inner_experts.w2_EDF") for c in checks)  # their gradient and stepped weight too
    assert not any(c.endswith(":layers.0.moe.routed_experts.inner_experts") for c in checks)
