"""The guide (docs/writing-a-suite.md) runs: its code blocks are the example's files, the example passes with
`--suite-path` at world sizes 1 and 2 with its known failure recorded `xfail`, the implementation without its
all-reduce fails naming the check, and a fix of the known failure is noticed (`xpass`)."""

from __future__ import annotations

import re

from helpers import ROOT, assert_one_cause

import shardcheck

GUIDE = ROOT / "docs" / "writing-a-suite.md"
EXAMPLE = ROOT / "docs" / "writing-a-suite"
SUITE = EXAMPLE / "my_ops_suite.py"
SUM_ALL_REDUCE = "        dist.all_reduce(sums, group=group)  # Σ exp and the target's logit, per token, in one call\n"
BLOCK = re.compile(r"<!-- file: (\S+) -->\n```python\n(.*?)```\n", re.S)


def test_the_guide_shows_the_example_files_and_nothing_else():
    """Each file of the example is the guide's blocks marked with its path, joined by two blank lines (the
    guide cuts it between top-level definitions): one source of truth."""
    blocks: dict[str, list[str]] = {}
    for path, code in BLOCK.findall(GUIDE.read_text()):
        blocks.setdefault(path, []).append(code.strip("\n"))
    assert sorted(blocks) == sorted(str(p.relative_to(ROOT)) for p in EXAMPLE.glob("*.py"))
    for path, parts in blocks.items():
        assert "\n\n\n".join(parts) + "\n" == (ROOT / path).read_text(), f"the guide's blocks of {path} differ from it"
    assert "FAILURE-OUTPUT" not in GUIDE.read_text()


def test_the_api_is_one_documented_place():
    names = [
        "Case",
        "Layout",
        "REPLICATED",
        "Shard",
        "Replicate",
        "Partial",
        "HeadTail",
        "PackedHeadTail",
        "Permuted",
        "GradSum",
        "GradConvention",
        "Property",
        "PrecisionOnly",
        "BadInput",
        "RankContext",
        "Topology",
        "KnownFailure",
        "FuzzSpace",
        "MemoryModel",
        "ModelCase",
        "Rule",
        "RuleSource",
        "OutsideSeed",
        "cite",
        "seed",
        "ours",
        "batch_invariance",
        "BatchInvariance",
    ]
    assert sorted(shardcheck.__all__) == sorted(names)
    lines = [line.strip() for line in shardcheck.__doc__.splitlines() if line.startswith("    ")]
    for name in [
        *names,
        "FAMILY:",
        "cases(quick: bool)",
        "bench_cases(quick: bool)",
        "IMPLEMENTATION:",
        "fuzz_spaces()",
    ]:
        assert any(line.startswith(name) for line in lines), f"the API's docstring does not list {name}"


def test_the_example_passes_with_its_known_failure_recorded(run_shardcheck):
    run = run_shardcheck("run", "--suite-path", str(SUITE), "--world-sizes", "1,2", "--quick")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    rows = run.rows
    counts = rows.groupby(["check", "status"]).size().to_dict()
    assert counts == {
        ("forward", "pass"): 45,
        ("grad:logits", "pass"): 45,
        ("property:comm", "pass"): 45,
        ("property:tp_ranks_agree", "pass"): 45,
        ("property:bad_input", "pass"): 3,
        ("property:bad_input", "xfail"): 3,
    }, counts
    assert set(rows[rows["status"] == "xfail"]["case_id"]) == {"bad-ids-beyond-vocab"}
    assert {tuple(t) for t in rows[["dp", "cp", "tp"]].values} == {(1, 1, 1), (2, 1, 1), (1, 1, 2)}
    assert "example.com/my-team/my-ops/issues/7" in run.stdout + (run.out / "report.md").read_text()


def test_the_implementation_without_its_all_reduce_fails_naming_the_check(run_shardcheck, tmp_path):
    source = (EXAMPLE / "my_ops.py").read_text()
    assert source.count(SUM_ALL_REDUCE) == 1
    broken = tmp_path / "my_ops_without_sum.py"
    broken.write_text(source.replace(SUM_ALL_REDUCE, ""))
    run = run_shardcheck(
        "run",
        "--suite-path",
        str(SUITE),
        "--impl",
        f"my_ops={broken}",
        "--world-sizes",
        "1,2",
        "--quick",
        "--dtype",
        "float64",
        "--case",
        "b4s6v37",
    )
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-2000:]
    failed = run.failed()
    assert set(failed["tp"]) == {2} and set(failed["status"]) == {"fail"}
    assert set(failed["check"]) == {"forward", "grad:logits", "property:tp_ranks_agree"}
    assert_one_cause(run)
    assert "FAIL my_ops.vocab_parallel_cross_entropy [b4s6v37] dp1-cp1-tp2 float64" in run.stdout
    rerun = next(line for line in run.stdout.splitlines() if line.startswith("rerun:"))
    assert f"--suite-path {SUITE}" in rerun and f"my_ops={broken}" in rerun


def test_a_fix_of_the_known_failure_is_noticed(run_shardcheck, tmp_path):
    fixed = tmp_path / "my_ops_checked.py"
    fixed.write_text(f"""
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, {str(EXAMPLE)!r})
from my_ops import vocab_parallel_cross_entropy as unchecked  # noqa: E402


def vocab_parallel_cross_entropy(logits, target, group=None, ignore_index=-100):
    vocab = torch.tensor([logits.shape[-1]])
    dist.all_reduce(vocab, group=group)
    if ((target != ignore_index) & ((target < 0) | (target >= vocab))).any():
        raise ValueError(f"target ids outside [0, {{int(vocab)}})")
    return unchecked(logits, target, group, ignore_index)
""")
    run = run_shardcheck(
        "run",
        "--suite-path",
        str(SUITE),
        "--impl",
        f"my_ops={fixed}",
        "--topology",
        "dp=1,cp=1,tp=2",
        "--case",
        "bad-*",
    )
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-2000:]
    statuses = dict(zip(run.rows["case_id"], run.rows["status"]))
    assert statuses == {"bad-target-shape": "pass", "bad-ids-beyond-vocab": "xpass"}


# ---- the parameter-gradient recipe (docs/writing-a-suite/tp_mlp_suite.py) ----------------------------------------

MLP_SUITE = EXAMPLE / "tp_mlp_suite.py"
GRAD_SUM = '            local = GradSum.apply(local, (ctx.group("dp"),))\n'


def test_the_parameter_gradient_recipe_passes_checking_every_parameter(run_shardcheck):
    run = run_shardcheck("run", "--suite-path", str(MLP_SUITE), "--world-sizes", "1,2", "--dtype", "float64,bfloat16")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    rows = run.rows
    assert (rows["status"] == "pass").all()
    assert set(rows["check"]) == {
        "forward",
        "grad:x",
        "grad:up.weight",
        "grad:up.bias",
        "grad:down.weight",
        "grad:down.bias",
    }
    assert {tuple(t) for t in rows[["dp", "cp", "tp"]].values} == {(1, 1, 1), (2, 1, 1), (1, 1, 2)}
    assert set(rows["case_id"]) == {"b4", "b7"}  # b7: uneven batch pieces over DP


def test_the_recipe_without_its_grad_sum_fails_naming_the_parameters(run_shardcheck, tmp_path):
    source = MLP_SUITE.read_text()
    assert source.count(GRAD_SUM) == 1
    broken = tmp_path / "tp_mlp_suite.py"
    broken.write_text(
        source.replace(GRAD_SUM, "            pass\n").replace(
            'IMPLEMENTATION = "tp_mlp.py"', f"IMPLEMENTATION = {str(EXAMPLE / 'tp_mlp.py')!r}"
        )
    )
    run = run_shardcheck(
        "run", "--suite-path", str(broken), "--world-sizes", "1,2", "--dtype", "float64", "--case", "b4"
    )
    assert run.returncode == 1
    failed = run.failed()
    assert set(failed["dp"]) == {2} and set(failed["status"]) == {"fail"}
    assert set(failed["check"]) == {"grad:up.weight", "grad:up.bias", "grad:down.weight", "grad:down.bias"}
    assert_one_cause(run)
